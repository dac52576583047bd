"""POST /v1/completions: prompts (text, token ids, or lists of either), echo, logprobs, streaming."""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShuttingDownError,
    QueueFullError,
    RequestAbortedError,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.server.protocol import (
    SSE_DONE,
    SSE_PING,
    APIError,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    error_body,
    random_id,
    sse,
)
from pagedserve.server.serving_base import (
    ClientDisconnected,
    OpenAIServing,
    SSEResponse,
    engine_error_to_api,
    merge_streams,
    run_until_disconnect,
)

logger = logging.getLogger("pagedserve.server")


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", 400, param="suffix")
        prompts = self._prompts(req)
        if req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
        else:
            prompt_logprobs = req.prompt_logprobs
        params = [self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                       prompt_logprobs=prompt_logprobs) for _ in prompts]
        base = random_id("cmpl")
        rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        if req.stream:
            streams = await self.submit(rids, prompts, params)
            return SSEResponse(self._stream(req, base, rids, streams, prompts), on_close=lambda: self.abort_all(rids))
        try:
            body = await run_until_disconnect(raw, self._full(req, base, rids, prompts, params))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise APIError("The prompt must not be empty.", 400, param="prompt")
        elif isinstance(p[0], int):
            items = [list(p)]
        else:
            items = list(p)
        self.validator.check_num_prompts(len(items))
        out = []
        for it in items:
            if isinstance(it, str):
                if not it:
                    raise APIError("The prompt must not be empty.", 400, param="prompt")
                out.append((it, self.encode_prompt(it, req.add_special_tokens)))
            else:
                out.append((None, list(it)))
        return out

    def _prompt_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

    async def _full(self, req, base, rids, prompts, params) -> dict:
        streams = await self.submit(rids, prompts, params)
        finals: list = [None] * len(streams)
        try:
            async for item in merge_streams(streams, None):
                i, out = item
                finals[i] = out
        except Exception as e:  # noqa: BLE001
            raise engine_error_to_api(e) from None
        finally:
            self.abort_all(rids)  # no-op for finished requests
        choices = []
        n_prompt = n_gen = 0
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            prefix = self._prompt_text(prompts[i]) if req.echo else ""
            for o in sorted(out.outputs, key=lambda o: o.index):
                n_gen += len(o.token_ids)
                lp = None
                if req.logprobs is not None:
                    ids, lps = list(o.token_ids), list(o.logprobs or [])
                    if req.echo and out.prompt_logprobs is not None:
                        ids = list(out.prompt_token_ids) + ids
                        lps = list(out.prompt_logprobs) + lps
                    lp = self.completion_logprobs(ids, lps, req.logprobs, 0)
                choices.append(CompletionResponseChoice(
                    index=i * req.n + o.index, text=prefix + o.text, logprobs=lp,
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        resp = CompletionResponse(id=base, model=self.ctx.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen,
                                                  total_tokens=n_prompt + n_gen))
        return resp.model_dump()

    async def _stream(self, req, base, rids, streams, prompts) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.ctx.model_name
        n = req.n
        nc = len(prompts) * n
        prev_text = [0] * nc
        prev_tok = [0] * nc
        offset = [0] * nc
        started = [False] * nc
        done = [False] * nc
        gen_tokens = [0] * nc
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        n_prompt = sum(len(ids) for _, ids in prompts)

        def usage() -> UsageInfo:
            g = sum(gen_tokens)
            return UsageInfo(prompt_tokens=n_prompt, completion_tokens=g, total_tokens=n_prompt + g)

        try:
            async for item in merge_streams(streams, self.ctx.ping_seconds):
                if item is None:
                    yield SSE_PING
                    continue
                i, out = item
                for o in out.outputs:
                    idx = i * n + o.index
                    if done[idx]:
                        continue
                    delta = o.text[prev_text[idx]:]
                    new_ids = list(o.token_ids[prev_tok[idx]:])
                    new_lps = list(o.logprobs[prev_tok[idx]:]) if (o.logprobs is not None) else []
                    if req.echo and not started[idx]:
                        delta = self._prompt_text(prompts[i]) + delta
                        if req.logprobs is not None and out.prompt_logprobs is not None:
                            new_ids = list(out.prompt_token_ids) + new_ids
                            new_lps = list(out.prompt_logprobs) + new_lps
                    fin = o.finish_reason
                    want_lp = req.logprobs is not None and bool(new_ids)
                    if not delta and not want_lp and fin is None:
                        continue
                    started[idx] = True
                    lp = None
                    if req.logprobs is not None:
                        lp = self.completion_logprobs(new_ids, new_lps, req.logprobs, offset[idx])
                    offset[idx] += len(delta)
                    prev_text[idx] = len(o.text)
                    prev_tok[idx] = len(o.token_ids)
                    gen_tokens[idx] = len(o.token_ids)
                    if fin is not None:
                        done[idx] = True
                    chunk = CompletionStreamResponse(
                        id=base, created=created, model=model,
                        choices=[CompletionResponseChoice(index=idx, text=delta, logprobs=lp, finish_reason=fin,
                                                          stop_reason=o.stop_reason if fin else None)],
                        usage=usage() if continuous else None)
                    yield sse(chunk)
            if include_usage:
                yield sse(CompletionStreamResponse(id=base, created=created, model=model, choices=[], usage=usage()))
        except (APIError, InvalidRequestError, EngineDeadError, RequestAbortedError, QueueFullError,
                EngineShuttingDownError) as e:
            err = engine_error_to_api(e)
            yield sse(error_body(err.message, err.status_code, err.type, err.param, err.code))
        except Exception as e:  # noqa: BLE001 - a bug: report it in-band, the stream is already open
            logger.exception("completion stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
        finally:
            self.abort_all(rids)
        yield SSE_DONE
