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
    EngineStepError,
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
        self.check_request(req)
        prompts = self._prompts(req)
        # echo with max_tokens 0 scores the prompt: one token is computed and left out of the answer
        score_only = req.echo and req.max_tokens == 0
        if req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
        else:
            prompt_logprobs = req.prompt_logprobs
        params = [self.sampling_params(req, max_tokens=1 if score_only else req.max_tokens, logprobs=req.logprobs,
                                       prompt_logprobs=prompt_logprobs) for _ in prompts]
        base = self.response_id(req, "cmpl")
        rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        if req.stream:
            streams = await self.submit(rids, prompts, params)
            return SSEResponse(self._stream(req, base, rids, streams, prompts, score_only),
                               on_close=lambda: self.abort_all(rids))
        try:
            body = await run_until_disconnect(raw, self._full(req, base, rids, prompts, params, score_only))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; a prompt cut by truncate_prompt_tokens keeps no text."""
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
            if not it:
                raise APIError("The prompt must not be empty.", 400, param="prompt")
            text, ids = (it, self.encode_prompt(it, req.add_special_tokens)) if isinstance(it, str) else (None, list(it))
            cut = self.truncate_prompt(req, ids)
            out.append((text if len(cut) == len(ids) else None, cut))
        return out

    def _prompt_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

    def _choice(self, req, index: int, out, o, prompt, score_only: bool) -> CompletionResponseChoice:
        """One finished choice; with score_only the computed token is dropped (only the prompt is echoed)."""
        gen_ids = [] if score_only else list(o.token_ids)
        gen_lps = [] if score_only else list(o.logprobs or [])
        text = "" if score_only else o.text
        lp = None
        if req.logprobs is not None:
            ids, lps = gen_ids, gen_lps
            if req.echo and out.prompt_logprobs is not None:
                ids = list(out.prompt_token_ids) + ids
                lps = list(out.prompt_logprobs) + lps
            lp = self.completion_logprobs(ids, lps, req.logprobs, 0, bool(req.return_tokens_as_token_ids))
        return CompletionResponseChoice(
            index=index, text=(self._prompt_text(prompt) if req.echo else "") + text, logprobs=lp,
            finish_reason="length" if score_only else o.finish_reason, stop_reason=None if score_only else o.stop_reason,
            prompt_logprobs=self.prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
            token_ids=gen_ids if req.return_token_ids else None)

    async def _full(self, req, base, rids, prompts, params, score_only: bool) -> dict:
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
            for o in sorted(out.outputs, key=lambda o: o.index):
                n_gen += 0 if score_only else len(o.token_ids)
                choices.append(self._choice(req, i * req.n + o.index, out, o, prompts[i], score_only))
        resp = CompletionResponse(id=base, model=self.ctx.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen,
                                                  total_tokens=n_prompt + n_gen),
                                  system_fingerprint=self.ctx.system_fingerprint)
        return resp.model_dump()

    async def _stream(self, req, base, rids, streams, prompts, score_only: bool) -> AsyncIterator[str]:
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
        as_ids = bool(req.return_tokens_as_token_ids)

        def usage() -> UsageInfo:
            g = sum(gen_tokens)
            return UsageInfo(prompt_tokens=n_prompt, completion_tokens=g, total_tokens=n_prompt + g)

        def chunk(choice: CompletionResponseChoice) -> str:
            return sse(CompletionStreamResponse(id=base, created=created, model=model, choices=[choice],
                                                usage=usage() if continuous else None,
                                                system_fingerprint=self.ctx.system_fingerprint))

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
                    if score_only:  # prompt scoring: one chunk, once the prompt has been computed
                        done[idx] = True
                        yield chunk(self._choice(req, idx, out, o, prompts[i], True))
                        continue
                    delta = o.text[prev_text[idx]:]
                    new_ids = list(o.token_ids[prev_tok[idx]:])
                    new_lps = list(o.logprobs[prev_tok[idx]:]) if (o.logprobs is not None) else []
                    lp_ids, lp_lps = new_ids, new_lps
                    first = not started[idx]
                    if req.echo and first:
                        delta = self._prompt_text(prompts[i]) + delta
                        if req.logprobs is not None and out.prompt_logprobs is not None:
                            lp_ids = list(out.prompt_token_ids) + new_ids
                            lp_lps = list(out.prompt_logprobs) + new_lps
                    fin = o.finish_reason
                    want_lp = req.logprobs is not None and bool(lp_ids)
                    if not delta and not want_lp and fin is None and not new_ids:
                        continue
                    started[idx] = True
                    lp = None
                    if req.logprobs is not None:
                        lp = self.completion_logprobs(lp_ids, lp_lps, req.logprobs, offset[idx], as_ids)
                    offset[idx] += len(delta)
                    prev_text[idx] = len(o.text)
                    prev_tok[idx] = len(o.token_ids)
                    gen_tokens[idx] = len(o.token_ids)
                    if fin is not None:
                        done[idx] = True
                    yield chunk(CompletionResponseChoice(
                        index=idx, text=delta, logprobs=lp, finish_reason=fin,
                        stop_reason=o.stop_reason if fin else None,
                        prompt_logprobs=(self.prompt_logprobs_json(out.prompt_logprobs)
                                         if first and req.prompt_logprobs is not None else None),
                        prompt_token_ids=list(out.prompt_token_ids) if first and req.return_token_ids else None,
                        token_ids=new_ids if req.return_token_ids else None))
            if include_usage:
                yield sse(CompletionStreamResponse(id=base, created=created, model=model, choices=[], usage=usage(),
                                                   system_fingerprint=self.ctx.system_fingerprint))
        except (APIError, InvalidRequestError, EngineDeadError, EngineStepError, RequestAbortedError, QueueFullError,
                EngineShuttingDownError) as e:
            err = engine_error_to_api(e)
            yield sse(error_body(err.message, err.status_code, err.type, err.param, err.code))
        except Exception as e:  # noqa: BLE001 - a bug: report it in-band, the stream is already open
            logger.exception("completion stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
        finally:
            self.abort_all(rids)
        yield SSE_DONE
