"""Is this host steady enough to benchmark on? (issue #8)

A shared VM's vCPUs can land on one physical core, or share its AMX unit with a neighbour, without
any steal showing in vmstat: on an AMX Xeon host a bf16 GEMM of the small model's
gate/up shape ran 300-900 GFLOP/s on one thread, and for long stretches two threads were no faster
than one. Run this before and after each A/B pair and set aside pairs taken in a slow phase.

    .venv/bin/python benchmarks/cpu_host_check.py [--rounds 10] [--dtype bfloat16]
"""
import argparse
import statistics
import time

import torch


def rate(a, packed, threads: int, calls: int = 40) -> float:
    torch.set_num_threads(threads)
    for _ in range(3):
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    return calls * 2 * a.shape[0] * a.shape[1] * packed.shape[0] / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rows", type=int, default=226, help="batch rows (a W1 decode step is ~226)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    w = (torch.randn(3072, 512) * 0.02).to(dtype)  # the small model's fused gate/up projection
    packed = torch.ops.mkldnn._reorder_linear_weight(w, args.rows)
    a = torch.randn(args.rows, 512).to(dtype)
    ones, twos = [], []
    for r in range(args.rounds):
        ones.append(rate(a, packed, 1))
        twos.append(rate(a, packed, 2))
        print(f"round {r + 1}: 1 thread {ones[-1]:6.0f}  2 threads {twos[-1]:6.0f} GFLOP/s  "
              f"(2 / 1 = {twos[-1] / ones[-1]:.2f})", flush=True)
    print(f"median: 1 thread {statistics.median(ones):.0f}, 2 threads {statistics.median(twos):.0f} GFLOP/s; "
          f"spread of 1-thread rate {max(ones) / min(ones):.2f}x")


if __name__ == "__main__":
    main()
