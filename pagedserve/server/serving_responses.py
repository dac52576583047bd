"""POST /v1/responses (the OpenAI Responses API, text in and text out) and GET /v1/responses/{id}.

A response's conversation (its input, after those of the responses it continues, plus its answer)
is kept in memory when `store` is true (the default), so a later request can continue it with
`previous_response_id`. The store is bounded: the oldest responses are forgotten first, and a
forgotten id is a 404 like an unknown one. As in OpenAI's API, `instructions` apply to one
response only and are not carried into the next.

Streaming sends OpenAI's typed events (response.created ... response.completed), each as
`event: <type>` plus `data: <json>`.
"""
from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.request_fields import structured_outputs_from_text_format
from pagedserve.server.protocol import (
    APIError,
    ResponsesRequest,
    error_body,
    random_id,
    reject_unsupported,
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

MAX_STORED_RESPONSES = 1024  # conversations kept for previous_response_id (oldest forgotten first)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """response id -> (conversation so far, the response object); least recently stored goes first."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict], response: dict) -> None:
        self._items[response_id] = (conversation, response)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict]:
        try:
            return self._items[response_id]
        except KeyError:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param="previous_response_id",
                           code="response_not_found") from None

    def __len__(self) -> int:
        return len(self._items)


def _input_messages(inp: Any) -> list[dict]:
    """The request's `input` as chat messages with text content."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    out = []
    for i, item in enumerate(inp):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise APIError(f"input[{i}]: items of type {kind!r} are not supported (only messages with text).", 400,
                           param="input")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS or not isinstance(p.get("text"), str):
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise APIError(f"input[{i}]: content of type {kind!r} is not supported (only text).", 400,
                                   param="input")
                texts.append(p["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise APIError(f"input[{i}].content must be text.", 400, param="input")
        # OpenAI's "developer" messages are the system prompt of models without that role
        out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content})
    if not out:
        raise APIError("input must not be empty.", 400, param="input")
    return out


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, ctx, store: ResponseStore | None = None):
        super().__init__(ctx)
        self.store = store or ResponseStore()

    def _check(self, req: ResponsesRequest) -> None:
        reject_unsupported(req)
        if req.tools:
            raise APIError("tools are not supported in the Responses API yet (tool calling is not implemented).",
                           400, param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice: only 'none' or 'auto' (with no tools) is supported.", 400,
                           param="tool_choice")
        try:
            structured_outputs_from_text_format((req.text or {}).get("format"))
        except InvalidRequestError as e:
            raise APIError(str(e), 400, param=e.param) from None
        if req.truncation not in (None, "disabled"):
            raise APIError("truncation: only 'disabled' is supported (a prompt too long is a 400).", 400,
                           param="truncation")
        if req.service_tier not in (None, "auto", "default"):
            raise APIError(f"service_tier {req.service_tier!r} is not supported (only 'auto' or 'default').", 400,
                           param="service_tier")
        if req.user and self.ctx.log_requests:
            logger.info("response request from user %r", req.user)

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self._check(req)
        history = list(self.store.get(req.previous_response_id)[0]) if req.previous_response_id else []
        conversation = history + _input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        text = self.render_chat(system + conversation)
        ids = self.encode_prompt(text, False, "input")
        d = self.ctx.sampling_defaults
        params = SamplingParams(temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
                                top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                                top_k=d.get("top_k", 0), min_p=d.get("min_p", 0.0),
                                repetition_penalty=d.get("repetition_penalty", 1.0), max_tokens=req.max_output_tokens,
                                structured_outputs=structured_outputs_from_text_format((req.text or {}).get("format")))
        rid = random_id("resp").replace("-", "_", 1)
        streams = await self.submit([rid], [(text, ids)], [params], max_tokens_param="max_output_tokens")
        ctx = _Ctx(req, rid, conversation, int(time.time()))
        if req.stream:
            return SSEResponse(self._stream(ctx, streams[0]), on_close=lambda: self.engine.abort(rid))
        try:
            final = await run_until_disconnect(raw, self._collect(rid, streams))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._finish(ctx, final))

    async def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id)[1]

    async def _collect(self, rid, streams):
        final = None
        try:
            async for item in merge_streams(streams, None):
                final = item[1]
        except Exception as e:  # noqa: BLE001
            raise engine_error_to_api(e) from None
        finally:
            self.engine.abort(rid)
        return final

    # -- the response object --------------------------------------------------------------------
    def _object(self, ctx: "_Ctx", status: str, output: list, usage: dict | None = None,
                incomplete: str | None = None) -> dict:
        req = ctx.req
        return {
            "id": ctx.rid, "object": "response", "created_at": ctx.created, "status": status,
            "model": self.ctx.model_name, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice or "auto", "tools": [], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "store": req.store, "service_tier": "default", "background": False,
        }

    @staticmethod
    def _message(ctx: "_Ctx", text: str, status: str) -> dict:
        return {"type": "message", "id": ctx.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _finish(self, ctx: "_Ctx", final) -> dict:
        o = final.outputs[0]
        n_in, n_out = len(final.prompt_token_ids), len(o.token_ids)
        usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": n_in + n_out}
        incomplete = "max_output_tokens" if o.finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        resp = self._object(ctx, status, [self._message(ctx, o.text, status)], usage, incomplete)
        if ctx.req.store:
            self.store.put(ctx.rid, ctx.conversation + [{"role": "assistant", "content": o.text}], resp)
        return resp

    async def _stream(self, ctx: "_Ctx", stream) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **body) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **body}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        where = {"item_id": ctx.msg_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=self._object(ctx, "in_progress", []))
            yield event("response.in_progress", response=self._object(ctx, "in_progress", []))
            yield event("response.output_item.added", output_index=0,
                        item={**self._message(ctx, "", "in_progress"), "content": []})
            yield event("response.content_part.added", **where,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            sent, final = 0, None
            async for item in merge_streams([stream], self.ctx.ping_seconds):
                if item is None:
                    yield ": ping\n\n"
                    continue
                final = item[1]
                text = final.outputs[0].text
                if len(text) > sent:
                    yield event("response.output_text.delta", **where, delta=text[sent:], logprobs=[])
                    sent = len(text)
            resp = self._finish(ctx, final)
            msg = resp["output"][0]
            yield event("response.output_text.done", **where, text=msg["content"][0]["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=msg["content"][0])
            yield event("response.output_item.done", output_index=0, item=msg)
            yield event("response.incomplete" if resp["status"] == "incomplete" else "response.completed",
                        response=resp)
        except Exception as e:  # noqa: BLE001 - the stream is open: report in-band, as OpenAI's `error` event
            try:
                err = engine_error_to_api(e)
            except Exception:  # noqa: BLE001 - a bug
                logger.exception("responses stream failed")
                err = APIError(f"internal error: {type(e).__name__}: {e}", 500)
            yield event("error", code=str(err.code), message=err.message, param=err.param,
                        error=error_body(err.message, err.status_code, err.type, err.param, err.code)["error"])
        finally:
            self.engine.abort(ctx.rid)


class _Ctx:
    """What one response's builders share."""

    def __init__(self, req: ResponsesRequest, rid: str, conversation: list[dict], created: int):
        self.req, self.rid, self.conversation, self.created = req, rid, conversation, created
        self.msg_id = random_id("msg").replace("-", "_", 1)
