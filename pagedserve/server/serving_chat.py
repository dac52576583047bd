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
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.structured import StructuredOutputsParams
from pagedserve.structured.forced_tools import forced_call_schema, tool_calls_from_text
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
        self.check_request(req)
        tools, forced = self._check_tools(req)
        self._check_openai_options(req)
        text = self.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                chat_template_kwargs=req.chat_template_kwargs, tools=tools,
                                documents=req.documents)
        ids = self.encode_prompt(text, req.add_special_tokens, "messages")
        cut = self.truncate_prompt(req, ids)
        if len(cut) != len(ids):
            text, ids = None, cut
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
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=num_lp,
                                      prompt_logprobs=req.prompt_logprobs)
        if forced is not None:
            if params.structured_outputs is not None:
                raise APIError(f"tool_choice {req.tool_choice!r} forces a tool call's JSON: it cannot be combined "
                               f"with {params.structured_outputs.param}.", 400, param="tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=forced[0], param="tool_choice")
        rid = self.response_id(req, "chatcmpl")
        if req.stream:
            streams = await self.submit([rid], [(text, ids)], [params], max_tokens_param=max_param)
            return SSEResponse(self._stream(req, rid, streams[0], len(ids), forced),
                               on_close=lambda: self.engine.abort(rid))
        try:
            body = await run_until_disconnect(raw, self._full(req, rid, text, ids, params, max_param, forced))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    def _check_tools(self, req: ChatCompletionRequest) -> tuple[list[dict] | None, tuple | None]:
        """The tools to render into the prompt, and for 'required' or a named tool the forced call's
        (JSON schema, function name or None). With 'none' the model sees the tools (as in vLLM) and
        answers in text. 'auto' (the default when tools are given) needs tool-call parsing: a 400."""
        choice = req.tool_choice
        if req.parallel_tool_calls is not None and not req.tools:
            raise APIError("parallel_tool_calls is only allowed when tools are given.", 400,
                           param="parallel_tool_calls")
        if not req.tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools.", 400, param="tool_choice")
            return None, None
        if choice == "none":  # no call is made, so parallel_tool_calls changes nothing
            return req.tools, None
        if choice == "required" or isinstance(choice, dict):
            try:
                return req.tools, forced_call_schema(req.tools, choice, req.parallel_tool_calls)
            except InvalidRequestError as e:
                raise APIError(str(e), 400, param=e.param) from None
        shown = "auto (the default when tools are given)" if choice is None else repr(choice)
        raise APIError(f"tool_choice {shown} is not supported: tool-call parsing is not implemented. Use "
                       "'required' or a named function to force a call, or 'none' to get a text answer.", 400,
                       param="tool_choice")

    def _check_openai_options(self, req: ChatCompletionRequest) -> None:
        if req.modalities is not None and list(req.modalities) != ["text"]:
            raise APIError("modalities: only ['text'] is supported.", 400, param="modalities")
        if req.service_tier not in (None, "auto", "default"):
            raise APIError(f"service_tier {req.service_tier!r} is not supported (only 'auto' or 'default').", 400,
                           param="service_tier")

    def _echo(self, req: ChatCompletionRequest) -> str:
        """echo: the last message's content when its role is the reply's (vLLM's rule)."""
        if not req.echo:
            return ""
        last = req.messages[-1] if req.messages else {}
        role = ROLE if req.add_generation_prompt else last.get("role")
        if last.get("role") != role:
            return ""
        return self.normalize_messages([last])[0]["content"]

    def _logprobs(self, req, token_ids, lps) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return ChatLogprobs(content=self.chat_logprobs(list(token_ids), list(lps or []), req.top_logprobs or 0,
                                                       bool(req.return_tokens_as_token_ids)))

    def _role(self, req) -> str:
        return ROLE if req.add_generation_prompt else req.messages[-1].get("role", ROLE)

    async def _full(self, req, rid, text, ids, params, max_param: str, forced=None) -> dict:
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
        echo = self._echo(req)
        for o in sorted(final.outputs, key=lambda o: o.index):
            n_gen += len(o.token_ids)
            message, finish = ChatMessage(role=self._role(req), content=echo + o.text), o.finish_reason
            if forced is not None and finish == "stop":  # complete: the constraint guarantees it parses
                message, finish = ChatMessage(role=self._role(req), tool_calls=tool_calls_from_text(
                    o.text, forced[1])), "tool_calls"
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=message,
                logprobs=self._logprobs(req, o.token_ids, o.logprobs),
                finish_reason=finish, stop_reason=o.stop_reason,
                token_ids=list(o.token_ids) if req.return_token_ids else None))
        n_prompt = len(final.prompt_token_ids)
        resp = ChatCompletionResponse(
            id=rid, model=self.ctx.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen),
            system_fingerprint=self.ctx.system_fingerprint, service_tier=self._service_tier(req),
            prompt_logprobs=self.prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
            prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None)
        return resp.model_dump()

    @staticmethod
    def _service_tier(req) -> str:
        return "default"  # one tier: what OpenAI reports for 'auto' and 'default'

    async def _stream(self, req, rid, stream, n_prompt: int, forced=None) -> AsyncIterator[str]:
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

        tier = self._service_tier(req)
        as_list = bool(req.return_token_ids)

        def chunk(choice: ChatCompletionStreamChoice, **extra) -> str:
            return sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice],
                                                    usage=usage() if continuous else None,
                                                    system_fingerprint=self.ctx.system_fingerprint,
                                                    service_tier=tier, **extra))

        try:
            role, echo = self._role(req), self._echo(req)
            first = {}
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=role, content="")))
                if echo:
                    yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echo)))
            async for item in merge_streams([stream], self.ctx.ping_seconds):
                if item is None:
                    yield SSE_PING
                    continue
                out = item[1]
                if not first:  # the prompt's extras ride on the first chunk with generated tokens
                    first = {"prompt_token_ids": list(out.prompt_token_ids) if as_list else None,
                             "prompt_logprobs": (self.prompt_logprobs_json(out.prompt_logprobs)
                                                 if req.prompt_logprobs is not None else None)}
                    extra = first
                for o in out.outputs:
                    idx = o.index
                    if done[idx]:
                        continue
                    delta = o.text[prev_text[idx]:]
                    new_ids = o.token_ids[prev_tok[idx]:]
                    fin = o.finish_reason
                    if forced is not None:  # the call goes out whole once its JSON is complete
                        if fin is None:
                            continue
                        delta = o.text
                        if fin == "stop":
                            calls = tool_calls_from_text(o.text, forced[1])
                            yield chunk(ChatCompletionStreamChoice(index=idx, delta=DeltaMessage(tool_calls=[
                                {"index": k, **c} for k, c in enumerate(calls)]), finish_reason="tool_calls"),
                                **extra)
                            extra, done[idx], gen_tokens[idx] = {}, True, len(o.token_ids)
                            continue
                    want_lp = bool(req.logprobs) and bool(new_ids)
                    if not delta and not want_lp and fin is None and not (as_list and new_ids):
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
                        logprobs=lp, finish_reason=fin, stop_reason=o.stop_reason if fin else None,
                        token_ids=list(new_ids) if as_list else None), **extra)
                    extra = {}
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                       usage=usage(), system_fingerprint=self.ctx.system_fingerprint,
                                                       service_tier=tier))
        except (APIError, InvalidRequestError, EngineDeadError, EngineStepError, RequestAbortedError, QueueFullError,
                EngineShuttingDownError) as e:
            err = engine_error_to_api(e)
            yield sse(error_body(err.message, err.status_code, err.type, err.param, err.code))
        except Exception as e:  # noqa: BLE001 - a bug: report it in-band, the stream is already open
            logger.exception("chat stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
        finally:
            self.engine.abort(rid)
        yield SSE_DONE
