"""A/B of the float32 CPU GEMMs on a benchmark model's layer shapes: our native GEMM against
oneDNN with a prepacked weight (the path the engine took before) and torch's plain `linear`.

Not part of CI. For each row count (a decode batch, a prefill chunk) and each linear of a decoder
layer plus the LM head, the variants are alternated (native, oneDNN, torch, native, ...); the
medians give GFLOP/s per shape and, weighted by how often each shape runs per token, per row count.
The machine's FMA peak on the same threads (a register-only loop of independent FMAs in the
native library) is printed first, so each rate can be read as a fraction of it.

    python benchmarks/cpu_gemm_ab.py                        # small model, 32 / 256 / 1024 rows
    python benchmarks/cpu_gemm_ab.py --model medium --rows 256 --repeats 9
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pagedserve.bench.workloads import MODEL_SHAPES, VOCAB  # noqa: E402
from pagedserve.model import cpu_gemm  # noqa: E402


def layer_shapes(shape: dict) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, times per token) of a decoder layer's linears and the LM head."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    qkv = hd * (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    return [("qkv", h, qkv, layers), ("o", h, h, layers), ("gate_up", h, 2 * inter, layers),
            ("down", inter, h, layers), ("lm_head", h, VOCAB, 1)]


def variants(w: torch.Tensor, rows: int) -> dict:
    packed_native = cpu_gemm.pack_weight(w)
    packed_onednn = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    n = w.shape[0]
    return {
        "native": lambda x: cpu_gemm.linear(x, packed_native, n),
        "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_onednn, None, "none", [], ""),
        "torch": lambda x: F.linear(x, w),
    }


def time_once(fn, x, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rows", default="32,256,1024", help="comma-separated row counts (tokens per GEMM)")
    ap.add_argument("--repeats", type=int, default=7, help="alternated timings per variant and shape")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    args = ap.parse_args()
    if not cpu_gemm.usable():
        sys.exit("native GEMM unavailable here (needs g++ and an AVX2/FMA CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    peak = cpu_gemm.fma_peak_gflops(threads)
    print(f"model {args.model}, float32, {threads} threads, medians of {args.repeats} alternated runs; "
          f"FMA peak {peak:.1f} GFLOP/s")
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        totals = {"native": 0.0, "onednn": 0.0, "torch": 0.0}
        flops_total = 0.0
        for name, k, n, times in layer_shapes(MODEL_SHAPES[args.model]):
            w = torch.randn(n, k, generator=g) * 0.02
            x = torch.randn(rows, k, generator=g)
            fns = variants(w, rows)
            want = F.linear(x, w)
            for label, fn in fns.items():  # warm-up, and every variant computes the same product
                if not torch.allclose(fn(x), want, rtol=1e-3, atol=1e-3):
                    sys.exit(f"{label} disagrees with torch on {name} ({rows}×{k}·{k}×{n})")
            flops = 2.0 * rows * k * n
            calls = max(1, int(2e8 / flops))
            samples = {label: [] for label in fns}
            for _ in range(args.repeats):
                for label, fn in fns.items():
                    samples[label].append(time_once(fn, x, calls))
            med = {label: statistics.median(s) for label, s in samples.items()}
            for label in totals:
                totals[label] += med[label] * times
            flops_total += flops * times
            print(f"  rows {rows:5d} {name:8s} {k:5d}×{n:<6d} native {flops / med['native'] / 1e9:6.1f}  "
                  f"oneDNN {flops / med['onednn'] / 1e9:6.1f}  torch {flops / med['torch'] / 1e9:6.1f} GFLOP/s  "
                  f"native/oneDNN {med['onednn'] / med['native']:.2f}×")
        rate = {label: flops_total / s / 1e9 for label, s in totals.items()}
        print(f"rows {rows:5d} all shapes (weighted per token): native {rate['native']:.1f} "
              f"({rate['native'] / peak:.0%} of peak)  oneDNN {rate['onednn']:.1f} ({rate['onednn'] / peak:.0%})  "
              f"torch {rate['torch']:.1f} GFLOP/s  native/oneDNN {totals['onednn'] / totals['native']:.2f}×  "
              f"native/torch {totals['torch'] / totals['native']:.2f}×")


if __name__ == "__main__":
    main()
