"""StructuredOutputsParams: the constraint a request puts on its output, with vLLM's names."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema, as a dict or its text), regex, choice (a list of
    strings), grammar (Lark or GBNF/EBNF text) or json_object (any JSON object).
    whitespace_pattern: the regex JSON whitespace must match (default: none, compact JSON)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    # the request field it came from (errors name it): response_format, guided_json, ...
    param: str = field(default="structured_outputs", repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], param: str = "structured_outputs") -> "StructuredOutputsParams":
        if not isinstance(d, dict):
            raise InvalidRequestError(f"{param} must be an object, got {type(d).__name__}.", param)
        unknown = sorted(set(d) - set(_KINDS) - {"whitespace_pattern"} - {k for k, v in d.items() if v is None})
        if unknown:
            raise InvalidRequestError(f"{param}: unsupported key(s) {', '.join(unknown)}; supported: "
                                      f"{', '.join(_KINDS)}, whitespace_pattern.", param)
        return cls(**{k: v for k, v in d.items() if v is not None})

    def kind(self) -> str:
        """Which constraint is set; InvalidRequestError unless exactly one is."""
        param = self.param
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"{param} must set exactly one of {', '.join(_KINDS)}; got "
                                      f"{', '.join(given) or 'none'}.", param)
        return given[0]

    def cache_key(self) -> tuple:
        """What makes two constraints the same grammar (the compile cache's key)."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        return kind, value, self.whitespace_pattern
