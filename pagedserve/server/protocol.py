"""OpenAI wire format: pydantic request/response models and the error body.

Field names, defaults and JSON shapes follow the OpenAI API (and vLLM's extensions to it:
top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...). Unknown
request fields are accepted and logged (never silently dropped); parameters that would change
the output but are not implemented (tool calls, suffix, best_of)
are rejected with 400 by the serving code.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

logger = logging.getLogger("pagedserve.server")


# ------------------------------------------------------------------------------------------------
# errors
class APIError(Exception):
    """An error the client caused (or overload); rendered as OpenAI's error body."""

    def __init__(self, message: str, status_code: int = 400, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _default_type(status_code)
        self.param = param
        self.code = code if code is not None else status_code
        self.headers = headers


def _default_type(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, status_code: int = 400, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type or _default_type(status_code), param=param,
                                         code=code if code is not None else status_code)).model_dump()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------
# requests
#
# Every request field says how it is served, in its `json_schema_extra` (also visible in /docs):
#   supported - used as OpenAI / vLLM define it;
#   partial   - some values used, the others a 400 (checked by the serving code; `note` says which);
#   rejected  - accepted only at its default: anything else is a 400 naming the field (`why`).
# reject_unsupported() enforces "rejected" for every route; docs/api.md's table is generated from
# these marks (pagedserve/server/api_doc.py), and tests/test_api_fields.py fails when a field is
# neither read by the serving code nor rejected.
def supported(default: Any = None, note: str = "", **kw) -> Any:
    return Field(default, json_schema_extra={"support": "supported", "note": note}, **kw)


def partial(default: Any = None, note: str = "", **kw) -> Any:
    return Field(default, json_schema_extra={"support": "partial", "note": note}, **kw)


def rejected(default: Any = None, why: str = "", example: Any = True, **kw) -> Any:
    """`example`: a non-default value, which the field-coverage test sends to see the 400."""
    return Field(default, json_schema_extra={"support": "rejected", "note": why, "example": example}, **kw)


def field_support(model: type[BaseModel], name: str) -> dict:
    extra = model.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def reject_unsupported(req: BaseModel) -> None:
    """400 for any field marked `rejected` that is not at its default (reads __dict__, not the
    attributes: the coverage test tells reads by the serving code from this check)."""
    values = req.__dict__
    for name, f in type(req).model_fields.items():
        info = field_support(type(req), name)
        if info.get("support") != "rejected":
            continue
        v = values.get(name)
        if v is None or v == f.get_default(call_default_factory=True) or v in ([], {}):
            continue  # at its default, or empty (asks for nothing)
        raise APIError(f"{name} is not supported: {info.get('note')}.", 400, param=name)


class OpenAIBaseModel(BaseModel):
    # Accept unknown fields (clients send newer OpenAI fields) but say so in the log.
    # NaN / inf (pydantic parses "nan", "inf" strings) would poison the sampler: reject them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _log_extra_fields(self):
        extra = self.model_extra or {}
        if extra:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(sorted(extra)))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = supported(False, "a last chunk with the usage")
    continuous_usage_stats: bool | None = supported(False, "usage on every chunk")


class _CommonFields(OpenAIBaseModel):
    """Fields every generating route shares (completions, chat)."""
    model: str | None = supported(None, "must be a served model name (404 otherwise)")
    n: int = supported(1)
    temperature: float | None = supported(None, "default 1.0")
    top_p: float | None = supported(None)
    top_k: int | None = supported(None, "0 or -1: off")
    min_p: float | None = supported(None)
    presence_penalty: float | None = supported(0.0)
    frequency_penalty: float | None = supported(0.0)
    repetition_penalty: float | None = supported(None)
    seed: int | None = supported(None)
    stop: str | list[str] | None = supported(None)
    stop_token_ids: list[int] | None = supported(None)
    include_stop_str_in_output: bool = supported(False, "also includes a stop token's text")
    ignore_eos: bool = supported(False)
    min_tokens: int = supported(0, "stop strings are checked from the token after the min_tokens-th")
    skip_special_tokens: bool = supported(True)
    spaces_between_special_tokens: bool = partial(
        True, "true only: the tokenizer's own decoding, as vLLM with a fast tokenizer; false is a 400")
    stream: bool | None = supported(False)
    stream_options: StreamOptions | None = supported(None, "include_usage, continuous_usage_stats")
    logit_bias: dict[str, float] | None = supported(None, "token id -> bias, clamped to [-100, 100]")
    allowed_token_ids: list[int] | None = supported(None)
    bad_words: list[str] | None = supported(None)
    truncate_prompt_tokens: int | None = supported(None, "keep the last k prompt tokens; -1: max_model_len")
    prompt_logprobs: int | None = supported(None, "returned as `prompt_logprobs`")
    return_tokens_as_token_ids: bool | None = supported(None, "logprob tokens as 'token_id:N'")
    return_token_ids: bool | None = supported(None, "adds prompt_token_ids and token_ids")
    best_of: int | None = partial(None, "only equal to n (no candidate ranking); otherwise a 400")
    user: str | None = supported(None, "written to the request log")
    request_id: str | None = supported(None, "becomes the response id's suffix")
    max_tokens: int | None = supported(None, "default: what fits in max_model_len")
    response_format: dict[str, Any] | None = supported(
        None, "text, json_object, json_schema (the output always follows the schema; compact JSON)")
    structured_outputs: dict[str, Any] | None = supported(
        None, "one of json, regex, choice, grammar (Lark or GBNF), json_object; plus whitespace_pattern")
    guided_json: Any = supported(None, "as structured_outputs.json")
    guided_regex: str | None = supported(None, "as structured_outputs.regex")
    guided_choice: list[str] | None = supported(None, "as structured_outputs.choice")
    guided_grammar: str | None = supported(None, "as structured_outputs.grammar")
    guided_decoding_backend: str | None = partial(None, "'auto' or 'guidance' (llguidance); others a 400")
    guided_whitespace_pattern: str | None = supported(None, "the regex JSON whitespace must match")
    use_beam_search: bool = rejected(False, "beam search is not implemented")
    length_penalty: float = rejected(1.0, "only used by beam search, which is not implemented", 0.5)
    priority: int = rejected(0, "priority scheduling is not implemented (first come, first served)", 1)
    logits_processors: list[Any] | None = rejected(None, "custom logits processors are not loadable", ["x"])
    cache_salt: str | None = rejected(None, "per-tenant prefix-cache isolation is not implemented", "salt")
    kv_transfer_params: dict[str, Any] | None = rejected(None, "disaggregated prefill is not implemented",
                                                         {"x": 1})
    vllm_xargs: dict[str, Any] | None = rejected(None, "no custom extension takes extra arguments", {"x": 1})


# the prompt forms vLLM takes: text, token ids, or a batch of those (texts and token lists mixed)
PromptType = str | list[int] | list[str | list[int]]


class CompletionRequest(_CommonFields):
    prompt: PromptType = supported(..., "text, token ids, or a list mixing texts and token-id lists")
    suffix: str | None = rejected(None, "insertion (fill-in-the-middle) is not implemented", "end")
    logprobs: int | None = supported(None)
    echo: bool = supported(False, "with max_tokens 0 and logprobs: prompt scoring")
    add_special_tokens: bool = supported(True)
    prompt_embeds: Any = rejected(None, "prompt embeddings are not accepted", "AAAA")


class ChatCompletionRequest(_CommonFields):
    messages: list[dict[str, Any]] = supported(..., "text content (string or text parts)")
    logprobs: bool | None = supported(False)
    top_logprobs: int | None = supported(None)
    max_completion_tokens: int | None = supported(None)
    tools: list[dict[str, Any]] | None = partial(
        None, "rendered into the chat template; served with tool_choice 'none', 'required' or a named "
              "function (forced by the grammar); 'auto' (tool-call parsing) is a 400")
    tool_choice: Any = partial(None, "'none', 'required', a named function; 'auto' (the default when tools are "
                                     "given) is a 400")
    parallel_tool_calls: bool | None = supported(None, "with tool_choice 'required': false allows one call only")
    functions: list[dict[str, Any]] | None = rejected(None, "the legacy function-calling API is not implemented",
                                                      [{"name": "f"}])
    function_call: Any = rejected(None, "the legacy function-calling API is not implemented", "auto")
    echo: bool = supported(False, "prefixes the last message's content when it has the reply's role")
    reasoning_effort: str | None = rejected(None, "reasoning controls are not implemented", "low")
    include_reasoning: bool = rejected(True, "reasoning parsing is not implemented", False)
    modalities: list[str] | None = partial(None, "['text'] only")
    audio: dict[str, Any] | None = rejected(None, "audio output is not implemented", {"voice": "x"})
    prediction: dict[str, Any] | None = rejected(None, "predicted outputs are not implemented",
                                                 {"type": "content", "content": "x"})
    web_search_options: dict[str, Any] | None = rejected(None, "web search is not available",
                                                         {"search_context_size": "low"})
    store: bool | None = rejected(False, "completions are not stored", True)
    metadata: dict[str, str] | None = rejected(None, "only used with store, which is not implemented", {"k": "v"})
    service_tier: str | None = partial(None, "'auto' or 'default' (echoed as 'default'); others are a 400")
    documents: list[dict[str, str]] | None = supported(None, "passed to the chat template")
    chat_template: str | None = rejected(None, "a per-request chat template is not trusted; start the server "
                                               "with --chat-template", "{{ messages }}")
    mm_processor_kwargs: dict[str, Any] | None = rejected(None, "multimodal input is not implemented", {"x": 1})
    # vLLM extensions
    add_generation_prompt: bool = supported(True)
    continue_final_message: bool = supported(False, "not together with add_generation_prompt")
    add_special_tokens: bool = supported(False)
    chat_template_kwargs: dict[str, Any] | None = supported(None)


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses: text in, text out."""
    model: str | None = supported(None, "must be a served model name (404 otherwise)")
    input: str | list[dict[str, Any]] = supported(..., "text, or messages with text content")
    instructions: str | None = supported(None, "a system message for this response only")
    max_output_tokens: int | None = supported(None)
    temperature: float | None = supported(None)
    top_p: float | None = supported(None)
    stream: bool | None = supported(False, "OpenAI's typed events")
    previous_response_id: str | None = supported(None, "continues a stored response (kept in memory, bounded)")
    store: bool = supported(True, "keep the response for previous_response_id and GET /v1/responses/{id}")
    metadata: dict[str, str] | None = supported(None, "echoed in the response")
    user: str | None = supported(None, "written to the request log")
    text: dict[str, Any] | None = supported(None, "format: text, json_object, json_schema (output follows the schema)")
    tools: list[dict[str, Any]] | None = partial(None, "none (empty) only: tool calling is not implemented")
    tool_choice: Any = partial(None, "'none' or 'auto' with no tools")
    parallel_tool_calls: bool = supported(True, "echoed; no tool calls are made")
    truncation: str | None = partial(None, "'disabled' only")
    service_tier: str | None = partial(None, "'auto' or 'default' (reported as 'default'); others are a 400")
    reasoning: dict[str, Any] | None = rejected(None, "reasoning controls are not implemented", {"effort": "low"})
    include: list[str] | None = rejected(None, "extra output data is not implemented",
                                         ["message.output_text.logprobs"])
    background: bool | None = rejected(None, "background responses are not implemented", True)
    top_logprobs: int | None = rejected(None, "logprobs are not returned by this route (use chat completions)", 1)
    max_tool_calls: int | None = rejected(None, "tool calling is not implemented", 1)
    prompt: dict[str, Any] | None = rejected(None, "stored prompt templates are not implemented", {"id": "p"})
    conversation: Any = rejected(None, "stored conversations are not implemented (use previous_response_id)",
                                 "conv_1")


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = supported(None)
    prompt: str | None = supported(None, "this or messages")
    messages: list[dict[str, Any]] | None = supported(None, "rendered with the chat template")
    add_special_tokens: bool | None = supported(None)
    add_generation_prompt: bool = supported(True)
    continue_final_message: bool = supported(False)
    chat_template_kwargs: dict[str, Any] | None = supported(None)
    tools: list[dict[str, Any]] | None = supported(None, "rendered into the chat template, as for chat")
    return_token_strs: bool = supported(False)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = supported(None)
    tokens: list[int] = supported(...)


# ------------------------------------------------------------------------------------------------
# responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM extensions, filled only when asked (prompt_logprobs, return_token_ids)
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class _StreamChunk(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_empty_usage(self, handler):
        # OpenAI leaves `usage` out of chunks that carry none (rather than sending null)
        out = handler(self)
        if out.get("usage", 0) is None:
            del out["usage"]
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # a forced tool call (tool_choice required / named)

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler):
        d = handler(self)
        if d.get("tool_calls") is None:
            d.pop("tool_calls", None)
        return d


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    service_tier: str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # OpenAI sends only the fields a delta carries ({} for the final chunk)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class ChatCompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk with tokens
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # likewise


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def sse(obj: BaseModel | dict) -> str:
    """One server-sent event carrying a JSON object."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json(exclude_unset=False)
    else:
        import json

        payload = json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_PING = ": ping\n\n"
