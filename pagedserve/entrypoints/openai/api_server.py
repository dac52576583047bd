"""`python -m pagedserve.entrypoints.openai.api_server --model DIR ...`, as with vLLM.

Same flags and behaviour as `pagedserve serve`.
"""
from __future__ import annotations

import argparse
import sys

from pagedserve.engine.args import add_engine_args
from pagedserve.server.app import build_app  # noqa: F401 - re-exported for vLLM-style imports
from pagedserve.server.cli import add_server_args, run


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.entrypoints.openai.api_server",
        description="pagedserve OpenAI-compatible API server",
    )
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
