"""The quantized linear's two paths side by side, per row count: the kernel reading the integers
directly (`quant_linear_rows`) against dequantize-then-dense-GEMM, with the dense float32 linear as
the baseline; SmolLM2-135M's shapes, 4-bit (Q4_1-like) and 8-bit (Q8_0-like) groups of 32.
Alternated runs, medians. grouped.DIRECT_MAX_ROWS is set from where the direct kernel stops winning.

  python benchmarks/quant_linear_ab.py [--threads 2] [--rows 1 2 4 8 16 32 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from pagedserve.quant import cpu_kernels
from pagedserve.quant.grouped import GroupedWeight, pack_nibbles

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
if __import__("os").environ.get("QUANT_AB_SHAPES"):
    SHAPES = {k: SHAPES[k] for k in __import__("os").environ["QUANT_AB_SHAPES"].split(",")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.load()
    assert lib is not None, cpu_kernels.failure_reason()
    print(f"{args.threads} threads; ms per call, medians of {args.iters} alternated calls")
    print("| shape | bits | rows | dense f32 | direct | dequant+GEMM |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k)
        for bits in (4, 8):
            if bits == 4:
                w = GroupedWeight(pack_nibbles(torch.randint(0, 16, (n, k))), torch.rand(n, k // 32),
                                  torch.rand(n, k // 32), 4, 32, k)
            else:
                w = GroupedWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32), None,
                                  8, 32, k)
            for m in args.rows:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                buf = torch.empty(n, k)

                def direct():
                    lib.quant_linear_rows(x.data_ptr(), k, m, w.q.data_ptr(), bits, n, k, 32, w.scales.data_ptr(),
                                          w.offsets.data_ptr() if w.offsets is not None else None, None,
                                          y.data_ptr(), n, args.threads)

                def dequant():
                    lib.quant_dequant(w.q.data_ptr(), bits, n, k, 32, w.scales.data_ptr(),
                                      w.offsets.data_ptr() if w.offsets is not None else None, buf.data_ptr(),
                                      args.threads)
                    F.linear(x, buf)

                fns = {"dense": lambda: F.linear(x, dense), "direct": direct, "dequant": dequant}
                times = {key: [] for key in fns}
                for _ in range(args.iters):
                    for key, fn in fns.items():
                        t = time.perf_counter()
                        fn()
                        times[key].append((time.perf_counter() - t) * 1e3)
                med = {key: statistics.median(v) for key, v in times.items()}
                print(f"| {name} {n}x{k} | {bits} | {m} | {med['dense']:.3f} | {med['direct']:.3f} | {med['dequant']:.3f} |")


if __name__ == "__main__":
    main()
