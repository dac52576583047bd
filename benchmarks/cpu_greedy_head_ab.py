"""The greedy LM head three ways, alternated in one process: the plain float32 head + argmax, the
bfloat16 screen and the int8 screen (runner/greedy_head.py); with --dtype bfloat16, a bfloat16
head + argmax against its int8 screen.

Not part of CI. Uses a benchmark model's own LM head weights (built if missing) and hidden rows
like a final RMSNorm's output (unit rms, Gaussian). Prints median milliseconds per call, the
speed ratios against the plain head, the float32 logits each screen computes per row, and checks
that all three pick the same tokens:

    python benchmarks/cpu_greedy_head_ab.py                         # small model, 16 / 64 / 256 rows
    python benchmarks/cpu_greedy_head_ab.py --model medium --rows 256 --repeats 15
    python benchmarks/cpu_greedy_head_ab.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pagedserve.bench.workloads import bench_model_dir  # noqa: E402
from pagedserve.kernels.cpu import fused_ops as cpu_fused, gemm as cpu_gemm
from pagedserve.runner import greedy_head  # noqa: E402


def lm_head_weight(model: str) -> torch.Tensor:
    from safetensors import safe_open

    folder = bench_model_dir(model)
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").float()
    raise SystemExit(f"no lm_head.weight in {folder}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=9, help="alternated rounds; medians are reported")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if not cpu_gemm.usable():
        raise SystemExit("the native GEMM cannot run here (no compiler, or no AVX2/FMA)")
    torch.set_flush_denormal(True)
    w = lm_head_weight(args.model)
    dtype = getattr(torch, args.dtype)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
    lin.weight.data.copy_(w)
    head = cpu_gemm.NativeLinear(lin)
    ways = {"plain": None}
    for kind in ("bf16", "int8") if dtype == torch.float32 else ("int8",):
        try:
            ways[kind] = greedy_head.ScreenedGreedyHead(head, kind)
        except ValueError as e:
            print(f"{kind} screen: not here ({e})")
    print(f"{args.dtype} LM head [{w.shape[0]}, {w.shape[1]}] of model {args.model}, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats} alternated rounds")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype)
        times = {name: [] for name in ways}
        picks = {}
        for _ in range(args.repeats):
            for name, screen in ways.items():
                t0 = time.perf_counter()
                picks[name] = cpu_fused.argmax(head(x)) if screen is None else screen.argmax(x)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["plain"])
        line = [f"rows {m:5d}  plain head {1e3 * base:7.2f} ms"]
        for name, screen in ways.items():
            if screen is None:
                continue
            t = statistics.median(times[name])
            same = bool((picks[name] == picks["plain"]).all())
            line.append(f"{name} {1e3 * t:7.2f} ms ({base / t:.2f}x, {screen.computed / screen.rows:.1f} exact "
                        f"logits/row{'' if same else ', DIFFERENT TOKENS'})")
            screen.rows = screen.computed = 0
        print("  ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
