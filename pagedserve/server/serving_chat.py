"""POST /v1/chat/completions: messages → chat template → the engine → OpenAI chat shapes.

Streaming sends, per choice, the assistant role first, then content deltas, then a chunk with
the finish_reason (carrying any last text), then a usage chunk if stream_options.include_usage,
then `data: [DONE]`.
"""
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
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
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

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self._check_unsupported(req)
        text = self.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                chat_template_kwargs=req.chat_template_kwargs)
        ids = self.encode_prompt(text, req.add_special_tokens, "messages")
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs to be true.", 400, param="top_logprobs")
        if req.top_logprobs is not None and not (0 <= req.top_logprobs <= self.ctx.max_logprobs):
            raise APIError(f"top_logprobs must be between 0 and {self.ctx.max_logprobs}, got {req.top_logprobs}.",
                           400, param="top_logprobs")
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=num_lp)
        rid = random_id("chatcmpl")
        if req.stream:
            streams = await self.submit([rid], [(text, ids)], [params], max_tokens_param=max_param)
            return SSEResponse(self._stream(req, rid, streams[0], len(ids)), on_close=lambda: self.engine.abort(rid))
        try:
            body = await run_until_disconnect(raw, self._full(req, rid, text, ids, params, max_param))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        if req.tools and req.tool_choice not in (None, "none"):
            raise APIError("Tool calling is not supported yet (tools with tool_choice other than 'none').", 400,
                           param="tools")
        if req.functions:
            raise APIError("Function calling is not supported yet.", 400, param="functions")
        rf = req.response_format
        if rf is not None and rf.get("type") not in (None, "text"):
            raise APIError(f"response_format {rf.get('type')!r} is not supported yet (only 'text').", 400,
                           param="response_format")

    def _logprobs(self, req, token_ids, lps) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return ChatLogprobs(content=self.chat_logprobs(list(token_ids), list(lps or []), req.top_logprobs or 0))

    async def _full(self, req, rid, text, ids, params, max_param: str) -> dict:
        streams = await self.submit([rid], [(text, ids)], [params], max_tokens_param=max_param)
        final = None
        try:
            async for item in merge_streams(streams, None):
                final = item[1]
        except Exception as e:  # noqa: BLE001
            raise engine_error_to_api(e) from None
        finally:
            self.engine.abort(rid)
        choices = []
        n_gen = 0
        for o in sorted(final.outputs, key=lambda o: o.index):
            n_gen += len(o.token_ids)
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=ChatMessage(role=ROLE, content=o.text),
                logprobs=self._logprobs(req, o.token_ids, o.logprobs),
                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        n_prompt = len(final.prompt_token_ids)
        resp = ChatCompletionResponse(id=rid, model=self.ctx.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen,
                                                      total_tokens=n_prompt + n_gen))
        return resp.model_dump()

    async def _stream(self, req, rid, stream, n_prompt: int) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.ctx.model_name
        n = req.n
        prev_text = [0] * n
        prev_tok = [0] * n
        done = [False] * n
        gen_tokens = [0] * n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)

        def usage() -> UsageInfo:
            g = sum(gen_tokens)
            return UsageInfo(prompt_tokens=n_prompt, completion_tokens=g, total_tokens=n_prompt + g)

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice],
                                                    usage=usage() if continuous else None))

        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=ROLE, content="")))
            async for item in merge_streams([stream], self.ctx.ping_seconds):
                if item is None:
                    yield SSE_PING
                    continue
                out = item[1]
                for o in out.outputs:
                    idx = o.index
                    if done[idx]:
                        continue
                    delta = o.text[prev_text[idx]:]
                    new_ids = o.token_ids[prev_tok[idx]:]
                    fin = o.finish_reason
                    want_lp = bool(req.logprobs) and bool(new_ids)
                    if not delta and not want_lp and fin is None:
                        continue
                    lp = None
                    if req.logprobs and new_ids:
                        lp = self._logprobs(req, new_ids, (o.logprobs or [])[prev_tok[idx]:])
                    prev_text[idx] = len(o.text)
                    prev_tok[idx] = len(o.token_ids)
                    gen_tokens[idx] = len(o.token_ids)
                    if fin is not None:
                        done[idx] = True
                    yield chunk(ChatCompletionStreamChoice(
                        index=idx, delta=DeltaMessage(content=delta) if (delta or fin is None) else DeltaMessage(),
                        logprobs=lp, finish_reason=fin, stop_reason=o.stop_reason if fin else None))
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                       usage=usage()))
        except (APIError, InvalidRequestError, EngineDeadError, RequestAbortedError, QueueFullError,
                EngineShuttingDownError) as e:
            err = engine_error_to_api(e)
            yield sse(error_body(err.message, err.status_code, err.type, err.param, err.code))
        except Exception as e:  # noqa: BLE001 - a bug: report it in-band, the stream is already open
            logger.exception("chat stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
        finally:
            self.engine.abort(rid)
        yield SSE_DONE
