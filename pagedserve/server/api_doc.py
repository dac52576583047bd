"""docs/api.md's table of request fields, generated from the request models' support marks.

    python -m pagedserve.server.api_doc          # rewrite the table in docs/api.md
    python -m pagedserve.server.api_doc --check  # exit 1 if docs/api.md is out of date

Only the part between the markers is generated; the prose around it is written by hand.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    StreamOptions,
    TokenizeRequest,
    field_support,
)

BEGIN = "<!-- BEGIN GENERATED: request fields (python -m pagedserve.server.api_doc) -->"
END = "<!-- END GENERATED: request fields -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

ROUTES: list[tuple[str, type[BaseModel]]] = [
    ("POST /v1/completions", CompletionRequest),
    ("POST /v1/chat/completions", ChatCompletionRequest),
    ("POST /v1/responses", ResponsesRequest),
    ("stream_options (completions, chat)", StreamOptions),
    ("POST /tokenize", TokenizeRequest),
    ("POST /detokenize", DetokenizeRequest),
]

_LABEL = {"supported": "supported", "partial": "partly: other values are a 400", "rejected": "rejected with 400"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def field_table() -> str:
    out = []
    for route, model in ROUTES:
        out += [f"### {route}", "", "| field | status | notes |", "|---|---|---|"]
        for name in model.model_fields:
            info = field_support(model, name)
            out.append(f"| `{name}` | {_LABEL[info['support']]} | {_cell(info.get('note', ''))} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render(doc: str) -> str:
    """`doc` with the generated part replaced by the current table."""
    head, sep, rest = doc.partition(BEGIN)
    if not sep or END not in rest:
        raise ValueError(f"{DOC} lacks the generated-table markers")
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{field_table()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    current = DOC.read_text()
    fresh = render(current)
    if "--check" in argv:
        if fresh != current:
            print(f"{DOC} is out of date: run python -m pagedserve.server.api_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
