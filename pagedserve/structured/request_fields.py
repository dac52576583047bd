"""The OpenAI / vLLM request fields that ask for structured outputs, as one StructuredOutputsParams.

response_format (OpenAI: json_object, json_schema), structured_outputs (vLLM) and vLLM's older
guided_json / guided_regex / guided_choice / guided_grammar all say the same thing; a request may
use one of them. The compile (and its errors) happens in the engine, before the request is queued.
"""
from __future__ import annotations

from pagedserve.errors import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
# vLLM's backend names that this engine's one backend (llguidance) answers to
BACKENDS = (None, "auto", "guidance", "llguidance")


def _from_response_format(rf: dict) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise InvalidRequestError("response_format json_schema needs a `json_schema` object with a `schema` "
                                      "object.", "response_format")
        # OpenAI's `strict` asks for exactly what the constraint always gives: output that follows the schema
        return StructuredOutputsParams(json=js.get("schema", {}))
    raise InvalidRequestError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                              "'json_schema'.", "response_format")


def structured_outputs_from_request(req) -> StructuredOutputsParams | None:
    """The constraint a completions or chat request asks for, or None; InvalidRequestError naming the field."""
    backend = req.guided_decoding_backend
    if backend not in BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend {backend!r} is not available: this server's grammar "
                                  "engine is llguidance ('guidance'); leave it out or use 'auto'.",
                                  "guided_decoding_backend")
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs:
        found.append(("structured_outputs", StructuredOutputsParams.from_dict(req.structured_outputs)))
    for field, kind in _GUIDED:
        v = getattr(req, field)
        if v is not None:
            found.append((field, StructuredOutputsParams(**{kind: v})))
    if len(found) > 1:
        raise InvalidRequestError(f"ask for one constraint only; got {', '.join(f for f, _ in found)}.", found[1][0])
    ws = req.guided_whitespace_pattern
    if not found:
        if ws is not None:
            raise InvalidRequestError("guided_whitespace_pattern needs a JSON constraint.", "guided_whitespace_pattern")
        return None
    field, so = found[0]
    if ws is not None:
        so.whitespace_pattern = ws
    so.param = field
    so.kind()  # exactly one constraint in it
    return so


def structured_outputs_from_text_format(fmt: dict | None) -> StructuredOutputsParams | None:
    """The Responses API's text.format: {"type": "json_schema", "name", "schema", "strict"} (flat), or
    json_object, or text."""
    fmt = fmt or {"type": "text"}
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {})}}
    try:
        so = _from_response_format(fmt)
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e).replace("response_format", "text.format"), "text") from None
    if so is not None:
        so.param = "text"
    return so
