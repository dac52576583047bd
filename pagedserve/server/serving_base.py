"""What every OpenAI route shares (OpenAIServing): model-name check, prompt tokenization and validation, SamplingParams
building, the max_tokens default (max_model_len - prompt length, as vLLM does), admission
control, submitting to the AsyncEngine, client-disconnect handling (abort → KV blocks freed),
SSE responses with keep-alive pings, logprob formatting, /tokenize and /detokenize.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse

from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShuttingDownError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.structured.request_fields import structured_outputs_from_request
from pagedserve.sampling_params import SamplingParams
from pagedserve.validation import check_token_ids
from pagedserve.server.protocol import (
    APIError,
    ChatLogprobToken,
    ChatTopLogprob,
    CompletionLogProbs,
    DetokenizeRequest,
    TokenizeRequest,
    random_id,
    reject_unsupported,
)

logger = logging.getLogger("pagedserve.server")

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def default_ping_seconds() -> float:
    try:
        return float(os.environ.get("PAGEDSERVE_SSE_PING_SECONDS", "5"))
    except ValueError:
        return 5.0


@dataclass
class ServingContext:
    engine: AsyncEngine
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    metrics: Any = None  # ServerMetrics
    chat_template: str | None = None
    log_requests: bool = True
    ping_seconds: float = field(default_factory=default_ping_seconds)
    system_fingerprint: str | None = None  # OpenAI's: names the serving configuration (version, model, dtype)
    sampling_defaults: dict = field(default_factory=dict)  # --generation-config: fields a request leaves out

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ClientDisconnected(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# transport helpers
class SSEResponse(StreamingResponse):
    """text/event-stream that always watches for the client going away.

    On disconnect the body generator is cancelled and closed (its `finally` aborts the engine
    requests) and `on_close` runs, whatever ASGI spec version the server speaks.
    """

    def __init__(self, content: AsyncIterator[str], on_close=None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[union-attr]
                if self._on_close is not None:
                    with contextlib.suppress(Exception):
                        self._on_close()


async def run_until_disconnect(raw: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (its finally aborts) and raise."""
    task = asyncio.ensure_future(coro)

    async def listen() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


_END = object()


async def merge_streams(streams: list, ping: float | None) -> AsyncIterator[tuple[int, Any] | None]:
    """Yield (stream index, latest output) across streams; None whenever `ping` s pass quietly."""
    if len(streams) == 1:
        s = streams[0]
        while True:
            try:
                out = await s.next(timeout=ping)
            except StopAsyncIteration:
                return
            yield None if out is None else (0, out)
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                q.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            try:
                item = await (q.get() if ping is None else asyncio.wait_for(q.get(), ping))
            except asyncio.TimeoutError:
                yield None
                continue
            i, x = item
            if x is _END:
                remaining -= 1
            elif isinstance(x, BaseException):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()


def engine_error_to_api(e: BaseException, metrics=None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(str(e), 400, param=e.param)
    if isinstance(e, QueueFullError):
        if metrics is not None:
            metrics.count_rejection(e.reason)
        return APIError(str(e), 503, code="server_overloaded", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineShuttingDownError):
        return APIError(str(e), 503, code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineStepError):
        return APIError(str(e), 500, code="engine_step_failed")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_dead")
    if isinstance(e, RequestAbortedError):
        return APIError("the request was aborted (the server is shutting down)", 503, code="aborted")
    raise e


# ------------------------------------------------------------------------------------------------
class OpenAIServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.engine = ctx.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- checks ------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is None or name in self.ctx.served_model_names:
            return
        raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")

    @property
    def validator(self):
        """The engine's RequestValidator (pagedserve/validation.py): the one place a request is checked;
        the engine runs it on every request, the server only adds the text bound before tokenizing."""
        return self.engine.engine_info.validator

    def encode_prompt(self, text, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Tokenize a request's text once the validator has ruled out a text too long to ever fit."""
        self.validator.check_prompt_text(text, param, allow_empty=True)
        return self.encode(text, add_special_tokens)

    def check_request(self, req) -> None:
        """Request-level checks every generating route shares: fields marked `rejected` in the
        protocol, then the values of `partial` fields that are not served."""
        reject_unsupported(req)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported (candidates are not ranked); use n.", 400,
                           param="best_of")
        if not req.spaces_between_special_tokens:
            raise APIError("spaces_between_special_tokens=false is not supported: text is decoded by the "
                           "tokenizer itself.", 400, param="spaces_between_special_tokens")
        self.validator.check_truncate_prompt_tokens(req.truncate_prompt_tokens)
        if req.user and self.ctx.log_requests:
            logger.info("request from user %r", req.user)

    def response_id(self, req, prefix: str) -> str:
        return f"{prefix}-{req.request_id}" if req.request_id else random_id(prefix)

    def truncate_prompt(self, req, ids: list[int]) -> list[int]:
        """truncate_prompt_tokens: keep the last k tokens (-1: max_model_len), as vLLM does."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        return ids[-(self.ctx.max_model_len if k == -1 else k):]

    @staticmethod
    def _logit_bias(req) -> dict[int, float] | None:
        if not req.logit_bias:
            return None
        out = {}
        for k, v in req.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {k!r}.", 400, param="logit_bias") from None
            out[t] = min(100.0, max(-100.0, float(v)))  # OpenAI's range
        return out

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's sampling fields as SamplingParams (a field the request leaves out takes the
        --generation-config default, else vLLM's); the engine validates them."""
        d = self.ctx.sampling_defaults

        def pick(name: str, fallback):
            v = getattr(req, name, None)
            return v if v is not None else d.get(name, fallback)

        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            logit_bias=self._logit_bias(req),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            structured_outputs=self._structured_outputs(req),
        )

    @staticmethod
    def _structured_outputs(req):
        try:
            return structured_outputs_from_request(req)
        except InvalidRequestError as e:
            raise APIError(str(e), 400, param=e.param) from None

    # -- engine submission ---------------------------------------------------------------------
    async def submit(self, request_ids: list[str], prompts: list[tuple[str | None, list[int]]],
                     params: list[SamplingParams], max_tokens_param: str = "max_tokens") -> list:
        """Queue the requests (all or none); the engine's InvalidRequestError becomes a 400 naming the
        field as the client sent it (`max_completion_tokens` for chat, when given)."""
        default_max = self.ctx.sampling_defaults.get("max_tokens")
        for p, (_, ids) in zip(params, prompts):
            # the model's default max_tokens, cut to what the context leaves (as vLLM cuts it); a
            # request that names max_tokens keeps its own
            if p.max_tokens is None and default_max is not None and len(ids) < self.ctx.max_model_len:
                p.max_tokens = min(default_max, self.ctx.max_model_len - len(ids))
        try:
            return await self.engine.add_requests(
                [(rid, text, p, ids) for rid, (text, ids), p in zip(request_ids, prompts, params)],
                arrival_time=time.time())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - engine errors become OpenAI errors
            err = engine_error_to_api(e, self.ctx.metrics)
            if err.param == "max_tokens" and max_tokens_param != "max_tokens":
                err.param, err.message = max_tokens_param, err.message.replace("max_tokens", max_tokens_param)
            raise err from None

    def abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)

    # -- logprobs ----------------------------------------------------------------------------
    def _tok_str(self, tid: int, lp, as_ids: bool = False) -> str:
        if as_ids:  # return_tokens_as_token_ids: tokens that are not valid UTF-8 alone stay exact
            return f"token_id:{tid}"
        s = getattr(lp, "decoded_token", None) if lp is not None else None
        if s is None:
            s = self.tokenizer.decode([tid])
        return s

    def completion_logprobs(self, token_ids: list[int], logprobs: list, num: int,
                            initial_offset: int, as_ids: bool = False) -> CompletionLogProbs:
        """top_logprobs per position: the chosen token first, then the num best (vLLM's order)."""
        out = CompletionLogProbs()
        offset = initial_offset
        for tid, lpd in zip(token_ids, logprobs):
            if lpd is None:  # the first prompt token has none
                tok = self._tok_str(tid, None, as_ids)
                out.tokens.append(tok)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                chosen = lpd.get(tid)
                tok = self._tok_str(tid, chosen, as_ids)
                out.tokens.append(tok)
                out.token_logprobs.append(max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else None)
                entries = ([(tid, chosen)] if chosen is not None else []) + sorted(
                    ((t, lp) for t, lp in lpd.items() if t != tid), key=lambda kv: -kv[1].logprob)[:num]
                top: dict[str, float] = {}
                for t, lp in entries:
                    top.setdefault(self._tok_str(t, lp, as_ids), max(lp.logprob, _MIN_LOGPROB))
                out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list, num: int,
                      as_ids: bool = False) -> list[ChatLogprobToken]:
        out = []
        for tid, lpd in zip(token_ids, logprobs):
            lpd = lpd or {}
            chosen = lpd.get(tid)
            tok = self._tok_str(tid, chosen, as_ids)
            ranked = sorted(lpd.items(), key=lambda kv: -kv[1].logprob)[:num]
            out.append(ChatLogprobToken(
                token=tok,
                logprob=max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else _MIN_LOGPROB,
                bytes=list(tok.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatTopLogprob(token=(s := self._tok_str(t, lp, as_ids)), logprob=max(lp.logprob, _MIN_LOGPROB),
                                   bytes=list(s.encode("utf-8", errors="replace")))
                    for t, lp in ranked
                ],
            ))
        return out

    @staticmethod
    def prompt_logprobs_json(plps: list | None) -> list[dict | None] | None:
        """RequestOutput.prompt_logprobs in vLLM's JSON shape: per prompt position None (the first)
        or {token id: {logprob, rank, decoded_token}}, -inf clamped as everywhere."""
        if plps is None:
            return None
        return [None if d is None else {
            str(t): {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in d.items()} for d in plps]

    # -- chat template (shared with /tokenize) ------------------------------------------------------
    def normalize_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise APIError("messages must not be empty.", 400, param="messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(f"messages[{i}] must be an object with a string 'role'.", 400, param="messages")
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if isinstance(p, str):
                        parts.append(p)
                    elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                        parts.append(p["text"])
                    else:
                        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                        raise APIError(f"messages[{i}]: content part of type {kind!r} is not supported "
                                       "(only text).", 400, param="messages")
                m["content"] = "\n".join(parts)
            elif content is None:
                m["content"] = ""
            elif not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string or a list of text parts.", 400,
                               param="messages")
            out.append(m)
        return out

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, documents: list[dict] | None = None) -> str:
        messages = self.normalize_messages(messages)
        tok = self.tokenizer
        template = self.ctx.chat_template
        if template is None and not getattr(tok, "chat_template", None):
            raise APIError("This model's tokenizer has no chat template; start the server with --chat-template.",
                           400, param="messages")
        if continue_final_message:
            if add_generation_prompt:
                raise APIError("Cannot set both continue_final_message and add_generation_prompt to true "
                               "(set add_generation_prompt to false).", 400, param="continue_final_message")
            if messages[-1].get("role") != "assistant":
                raise APIError("continue_final_message needs the last message to be from the assistant.", 400,
                               param="messages")
        kwargs = dict(chat_template_kwargs or {})
        for k in ("tokenize", "add_generation_prompt", "chat_template", "continue_final_message", "conversation",
                  "tools", "documents"):
            kwargs.pop(k, None)
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, chat_template=template,
                                           tools=tools, documents=documents, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles) are the client's
            raise APIError(f"Could not apply the chat template: {e}", 400, param="messages") from None
        if not isinstance(text, str):  # some versions return a list for a batch
            text = text[0]
        return text

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- /tokenize, /detokenize ---------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Give exactly one of 'prompt' or 'messages'.", 400, param="prompt")
        if req.messages is not None:
            text = self.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
            ids = self.encode_prompt(text, bool(req.add_special_tokens), "messages")
        else:
            ids = self.encode_prompt(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.ctx.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        if req.tokens:
            check_token_ids(req.tokens, self.validator.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}


# ------------------------------------------------------------------------------------------------
