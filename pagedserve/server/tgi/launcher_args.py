"""TGI's launcher flags, accepted by `pagedserve serve` and mapped onto pagedserve's own.

    --model-id X                  → --model X
    --num-shard N                 → --tensor-parallel-size N
    --max-total-tokens N          → --max-model-len N
    --max-batch-prefill-tokens N  → --max-num-batched-tokens N
    --max-batch-size N            → --max-num-seqs N
    --max-input-tokens N          (an engine flag of pagedserve's own: prompts longer than N are refused)
    --max-concurrent-requests N   429 once N generation requests are in flight
    --hostname H                  → --host H
    --cuda-memory-fraction F      → --gpu-memory-utilization F
    --tgi-metrics                 also export TGI's metric names (tgi_request_count, ...)
"""
from __future__ import annotations

import argparse

# TGI flag → (pagedserve dest, type, help)
ALIASES = {
    "--model-id": ("model", str, "TGI's name for --model"),
    "--num-shard": ("tensor_parallel_size", int, "TGI's name for --tensor-parallel-size"),
    "--max-total-tokens": ("max_model_len", int, "TGI's name for --max-model-len"),
    "--max-batch-prefill-tokens": ("max_num_batched_tokens", int, "TGI's name for --max-num-batched-tokens"),
    "--max-batch-size": ("max_num_seqs", int, "TGI's name for --max-num-seqs"),
    "--hostname": ("host", str, "TGI's name for --host"),
    "--cuda-memory-fraction": ("gpu_memory_utilization", float, "TGI's name for --gpu-memory-utilization"),
}


def add_tgi_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("TGI launcher flags (aliases for users moving from text-generation-inference)")
    for flag, (dest, typ, doc) in ALIASES.items():
        # default=SUPPRESS: an alias never overwrites the real flag's default or value
        g.add_argument(flag, dest=dest, type=typ, default=argparse.SUPPRESS, help=doc)
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="answer 429 once this many generation requests are in flight (TGI's flag; default: no limit)")
    g.add_argument("--tgi-metrics", action="store_true",
                   help="also export TGI's metric names (tgi_request_count, tgi_request_duration, ...) on /metrics")
    return parser


def check_tgi_args(args: argparse.Namespace) -> str | None:
    """One error line for a bad TGI flag value, or None."""
    v = getattr(args, "max_concurrent_requests", None)
    if v is not None and v < 1:
        return "--max-concurrent-requests must be >= 1"
    return None
