"""The `pagedserve plan` sub-command: arguments, errors as one line (exit 2), text or JSON."""
from __future__ import annotations

import argparse
import json
import sys

from pagedserve.plan.build import build_plan
from pagedserve.plan.inputs import KV_DTYPE_BYTES, QUANT_METHODS, QUANTIZATIONS, PlanError
from pagedserve.plan.report import format_text


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: memory, KV blocks, concurrency and decode ceiling for a model on a GPU",
        description="Estimate whether a Llama-family model fits a GPU, how many sequences run at once, which "
                    "engine flags to use, and the memory-bandwidth ceiling on decode speed. Reads config.json "
                    "only; no weights, no GPU needed.",
    )
    p.add_argument("--model", required=True, help="model directory containing config.json, or a config.json path")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H100-80GB, A100-40GB, L4 (unknown names list the known)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32", "half", "bf16"],
                   help="model dtype (auto: the checkpoint's; float32 checkpoints run in float16)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS) + list(QUANT_METHODS) + ["none"],
                   help="weight quantization of the linear layers: a size class (int8, int4, fp8) or the engine's "
                        "method (awq, gptq, compressed-tensors: bits from config.json; w8a8: 8-bit) "
                        "(default: from config quantization_config, else none)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (= model dtype), " + ", ".join(KV_DTYPE_BYTES))
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs per model replica")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length per sequence (default: config max_position_embeddings)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory the engine may use")
    p.add_argument("--target-concurrency", type=int, default=None,
                   help="sequences you want running at once (default: the recommended --max-num-seqs)")
    p.add_argument("--context-len", type=int, default=None,
                   help="tokens of context per sequence for the decode ceiling (default: max-model-len, worst case)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        plan = build_plan(args)
    except PlanError as e:
        print(f"pagedserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_text(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
