"""`pagedserve bench`: `serve` (load on an OpenAI-compatible server) and `throughput` (offline engine).

`bench serve` never imports torch. `bench throughput` lives in `pagedserve.bench.throughput`
(`add_arguments(parser)`, `run(args) -> int`); it is imported only when its sub-command is parsed,
so neither `bench serve` nor `pagedserve --help` pays for (or needs) torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

THROUGHPUT_MODULE = "pagedserve.bench.throughput"


def _run_serve(args) -> int:
    from pagedserve.bench import serve

    return serve.run(args)


def _load_throughput(parser: argparse.ArgumentParser) -> None:
    """Fill the `bench throughput` parser from its module, or make it explain why it can't run."""
    try:
        mod = importlib.import_module(THROUGHPUT_MODULE)
    except ModuleNotFoundError as e:  # not written yet, or a dependency (torch) is missing
        missing = e.name

        def _unavailable(args) -> int:
            print(f"bench throughput is unavailable: module {missing!r} not found", file=sys.stderr)
            return 2

        parser.set_defaults(func=_unavailable)
        return
    if mod.__doc__ and not parser.description:
        parser.description = mod.__doc__.strip()
    mod.add_arguments(parser)
    parser.set_defaults(func=mod.run)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serve (online load), throughput (offline engine)")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")

    from pagedserve.bench import serve  # no torch, aiohttp only when a run starts

    p = sub.add_parser(
        "serve",
        help="streaming load test of an OpenAI-compatible server",
        description="Send a bounded set of streaming requests to an OpenAI-compatible server (ours, vLLM, "
        "TGI's OpenAI route) and report throughput, TTFT/TPOT/ITL/E2E percentiles and goodput.",
    )
    serve.add_arguments(p)
    p.set_defaults(func=_run_serve)

    t = sub.add_parser("throughput", help="offline engine throughput, with the transformers baseline beside it")
    original = t.parse_known_args
    loaded = []

    def lazy_parse_known_args(args=None, namespace=None):
        if not loaded:
            loaded.append(True)
            _load_throughput(t)
        return original(args, namespace)

    t.parse_known_args = lazy_parse_known_args  # argparse parses a chosen sub-command through this
