"""tool_choice "required" or a named function: the call is forced by a JSON-schema constraint, so
it always parses.

Named function: the output is the function's arguments object (its `parameters` schema).
"required": the output is a JSON array of {"name", "arguments"} objects, each name one of the
tools with its own arguments schema; one item only when parallel_tool_calls is false.
"""
from __future__ import annotations

import json
import uuid

from pagedserve.errors import InvalidRequestError

_ANY_OBJECT = {"type": "object"}


def _functions(tools: list[dict]) -> dict[str, dict]:
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\", "
                                      "\"parameters\"}}.", "tools")
        out[fn["name"]] = fn.get("parameters") or _ANY_OBJECT
    return out


def forced_call_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> tuple[dict, str | None]:
    """(JSON schema of the output, the named function or None for "required")."""
    fns = _functions(tools)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in fns:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among the tools.",
                                      "tool_choice")
        return fns[name], name
    items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False} for n, params in fns.items()]
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema, None


def tool_calls_from_text(text: str, named: str | None) -> list[dict]:
    """The OpenAI tool_calls of a complete forced output (the constraint guarantees it parses)."""
    value = json.loads(text)
    calls = [(named, value)] if named is not None else [(c["name"], c["arguments"]) for c in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(args)}} for n, args in calls]
