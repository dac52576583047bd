"""A/B of the CPU GEMMs on a benchmark model's layer shapes: our native GEMM against oneDNN with a
prepacked weight (the path the engine took before) and torch's plain `linear`, in float32 or
bfloat16 (--dtype; oneDNN's prepacked path is left out where it refuses bfloat16 on this CPU).

Not part of CI. For each row count (a decode batch, a prefill chunk) and each linear of a decoder
layer plus the LM head, the variants are alternated (native, oneDNN, torch, native, ...); the
medians give GFLOP/s per shape and, weighted by how often each shape runs per token, per row count.
The machine's FMA peak on the same threads (a register-only loop of independent FMAs in the
native library) is printed first, so each rate can be read as a fraction of it.

Each shape's weight is timed hot (the same weight call after call, so it sits in cache) unless
--weights cycled: then every layer gets its own weights and a timing is one pass over the whole
model's linears in the forward's order (each layer's qkv, o, gate_up, down, then the LM head), so
that, as in the engine, each weight comes from memory when the model is larger than L3.

    python benchmarks/cpu_gemm_ab.py                        # small model, 32 / 256 / 1024 rows
    python benchmarks/cpu_gemm_ab.py --model medium --rows 256 --repeats 9
    python benchmarks/cpu_gemm_ab.py --dtype bfloat16 --rows 256
    python benchmarks/cpu_gemm_ab.py --model medium --rows 16,226 --weights cycled
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
from pagedserve.kernels.cpu import gemm as cpu_gemm  # noqa: E402


def layer_shapes(shape: dict) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, times per token) of a decoder layer's linears and the LM head."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    qkv = hd * (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    return [("qkv", h, qkv, layers), ("o", h, h, layers), ("gate_up", h, 2 * inter, layers),
            ("down", inter, h, layers), ("lm_head", h, VOCAB, 1)]


def with_tile(packed, switch, during, after):
    """Our linear on `packed` with the tile switched by switch(during), then switch(after)."""
    def run(x):
        switch(during)
        try:
            return cpu_gemm.linear(x, packed)
        finally:
            switch(after)
    return run


def variants(w: torch.Tensor, rows: int) -> dict:
    packed_native = cpu_gemm.pack_weight(w)
    out = {"native": lambda x: cpu_gemm.linear(x, packed_native)}
    if w.dtype == torch.bfloat16 and cpu_gemm.bf16_dot():  # the widening AVX-512 tile beside vdpbf16ps
        out["native_widen"] = with_tile(packed_native, cpu_gemm.set_bf16_dot, False, None)
    if w.dtype == torch.bfloat16 and cpu_gemm.bf16_k_pairs():  # the AVX2 tile beside the AVX-512 one
        interleaved = cpu_gemm.pack_weight(w, k_pairs=False)
        out["native_avx2"] = lambda x: cpu_gemm.linear(x, interleaved)
    if w.dtype == torch.float32 and cpu_gemm.vector_bits() == 512:  # the AVX2 tile beside the AVX-512 one
        out["native_avx2"] = with_tile(packed_native, cpu_gemm.set_avx512, False, True)
    try:
        packed_onednn = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_onednn, None, "none", [], "")  # noqa: E731
        onednn(torch.zeros(2, w.shape[1], dtype=w.dtype))
        out["onednn"] = onednn
    except RuntimeError:
        pass
    out["torch"] = lambda x: F.linear(x, w)
    return out


def time_once(fn, x, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls


def check(fns: dict, x: torch.Tensor, w: torch.Tensor, tol: float, what: str) -> None:
    """Warm-up, and every variant computes the same product."""
    want = F.linear(x.float(), w.float())
    for label, fn in fns.items():
        if not torch.allclose(fn(x).float(), want, rtol=tol, atol=tol):
            sys.exit(f"{label} disagrees with torch on {what}")


def hot_weights(args, dtype, tol, peak, g) -> None:
    for rows in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        flops_total = 0.0
        for name, k, n, times in layer_shapes(MODEL_SHAPES[args.model]):
            w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            fns = variants(w, rows)
            check(fns, x, w, tol, f"{name} ({rows}×{k}·{k}×{n})")
            flops = 2.0 * rows * k * n
            calls = max(1, int(2e8 / flops))
            samples = {label: [] for label in fns}
            for _ in range(args.repeats):
                for label, fn in fns.items():
                    samples[label].append(time_once(fn, x, calls))
            med = {label: statistics.median(s) for label, s in samples.items()}
            for label in med:
                totals[label] = totals.get(label, 0.0) + med[label] * times
            flops_total += flops * times
            rates = "  ".join(f"{label} {flops / t / 1e9:6.1f}" for label, t in med.items())
            print(f"  rows {rows:5d} {name:8s} {k:5d}×{n:<6d} {rates} GFLOP/s  "
                  + "  ".join(f"native/{label} {t / med['native']:.2f}×" for label, t in med.items() if label != "native"))
        summary(rows, "all shapes (weighted per token)", totals, flops_total, peak)


def cycled_weights(args, dtype, tol, peak, g) -> None:
    """One timing = a forward's pass over every layer's linears, each layer with its own weights."""
    shape = MODEL_SHAPES[args.model]
    per_layer = [s for s in layer_shapes(shape) if s[0] != "lm_head"]
    head = [s for s in layer_shapes(shape) if s[0] == "lm_head"]
    order = [per_layer] * shape["num_hidden_layers"] + [head]
    weights = [[(name, (torch.randn(n, k, generator=g) * 0.02).to(dtype)) for name, k, n, _ in layer]
               for layer in order]
    mib = sum(w.numel() * w.element_size() for layer in weights for _, w in layer) / 2**20
    print(f"cycled weights: {len(order) - 1} layers + LM head, {mib:.0f} MiB of weights per variant")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k, _, _ in per_layer + head}
        steps = []  # [(x, {label: fn})] in the forward's order
        for layer in weights:
            for name, w in layer:
                fns = variants(w, rows)
                check(fns, xs[w.shape[1]], w, tol, f"{name} ({rows}×{w.shape[1]}·{w.shape[1]}×{w.shape[0]})")
                steps.append((xs[w.shape[1]], fns))
        labels = list(steps[0][1])
        flops = sum(2.0 * rows * w.shape[1] * w.shape[0] for layer in weights for _, w in layer)
        samples = {label: [] for label in labels}
        for _ in range(args.repeats):
            for label in labels:
                t0 = time.perf_counter()
                for x, fns in steps:
                    fns[label](x)
                samples[label].append(time.perf_counter() - t0)
        med = {label: statistics.median(s) for label, s in samples.items()}
        print(f"  rows {rows:5d} one pass: " + "  ".join(f"{label} {t * 1e3:8.2f} ms" for label, t in med.items()))
        summary(rows, "cycled pass", med, flops, peak)


def summary(rows: int, what: str, totals: dict[str, float], flops: float, peak: float) -> None:
    rate = {label: flops / s / 1e9 for label, s in totals.items()}
    print(f"rows {rows:5d} {what}: "
          + "  ".join(f"{label} {r:.1f} ({r / peak:.0%} of peak)" for label, r in rate.items()) + " GFLOP/s  "
          + "  ".join(f"native/{label} {totals[label] / totals['native']:.2f}×" for label in totals if label != "native"))


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rows", default="32,256,1024", help="comma-separated row counts (tokens per GEMM)")
    ap.add_argument("--repeats", type=int, default=7, help="alternated timings per variant and shape")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="hot", choices=["hot", "cycled"],
                    help="hot: each shape's weight timed alone, in cache; cycled: passes over every layer's own weights")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    if not cpu_gemm.usable():
        sys.exit("native GEMM unavailable here (needs g++ and an AVX2/FMA CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    peak = cpu_gemm.fma_peak_gflops(threads)
    print(f"model {args.model}, {args.dtype}, {threads} threads, {args.weights} weights, "
          f"medians of {args.repeats} alternated runs; FMA peak {peak:.1f} GFLOP/s")
    g = torch.Generator().manual_seed(0)
    (cycled_weights if args.weights == "cycled" else hot_weights)(args, dtype, tol, peak, g)


if __name__ == "__main__":
    main()
