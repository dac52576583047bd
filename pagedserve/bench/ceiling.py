"""The machine's GEMM ceiling on a model's own layer shapes, measured in the benchmark's process.

Achieved FLOP/s only means something next to what the hardware reaches on the same matrices in
the same run. For each linear of a decoder layer and the LM head this times torch's plain
`linear` and, on the CPU, oneDNN with the weight prepacked and our native GEMM (float32, or
bfloat16 weights widened in the kernel: the path our CPU layers take where it builds and is the
faster), keeps the fastest per shape, and reports FLOPs / time over
the whole set of shapes at a decode-sized and a prefill-sized batch. The best of those is the
ceiling. The same figure over torch's own paths alone (plain `linear`, oneDNN prepacked) is
reported beside it: that is the ceiling as issue #8 defines it ("the best GEMM rate torch can
reach"), and the lower of the two wherever our GEMM is the faster.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _shapes(spec) -> list[tuple[int, int, int]]:
    """(in_features, out_features, times per token) of the decoder layers' GEMMs and the LM head."""
    h, hd, n = spec.hidden_size, spec.head_dim, spec.num_layers
    qkv = hd * (spec.num_heads + 2 * spec.num_kv_heads)
    return [(h, qkv, n), (spec.num_heads * hd, h, n), (h, 2 * spec.intermediate_size, n), (spec.intermediate_size, h, n),
            (h, spec.vocab_size, 1)]


def _best_seconds(fn, min_time: float) -> float:
    fn()
    best, spent, n = float("inf"), 0.0, 0
    while spent < min_time or n < 3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def _linear_variants(w: torch.Tensor, rows: int):
    """(is torch's own path, function x -> x @ w.T) for each GEMM that can run this weight here."""
    yield True, lambda x: F.linear(x, w)
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            fn(torch.zeros(2, w.shape[1], dtype=w.dtype))
            yield True, fn
        except (RuntimeError, AttributeError):
            pass
    if w.device.type == "cpu":
        from pagedserve.kernels.cpu import gemm as cpu_gemm

        if w.dtype in cpu_gemm.DTYPES and cpu_gemm.usable():
            packed_native = cpu_gemm.pack_weight(w)
            yield False, lambda x: cpu_gemm.linear(x, packed_native)


@torch.inference_mode()
def gemm_ceiling(spec, dtype: torch.dtype, device: torch.device | str = "cpu", rows=(256, 1024),
                 min_time: float = 0.1) -> dict:
    """{"gflops": best over `rows`, "by_rows": {rows: GFLOP/s}, and "torch_gflops" / "torch_by_rows",
    the same over torch's own GEMMs only} for this model's GEMM shapes."""
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(n, k, generator=g).to(device=device, dtype=dtype) * 0.02, times)
               for k, n, times in _shapes(spec)]
    by_rows, torch_by_rows = {}, {}
    for m in rows:
        flops = seconds = torch_seconds = 0.0
        for w, times in weights:
            x = torch.randn(m, w.shape[1], generator=g).to(device=device, dtype=dtype)
            sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
            timed = [(own, _best_seconds(lambda f=f: (f(x), sync()), min_time)) for own, f in _linear_variants(w, m)]
            flops += 2.0 * m * w.shape[0] * w.shape[1] * times
            seconds += min(t for _, t in timed) * times
            torch_seconds += min(t for own, t in timed if own) * times
        by_rows[m] = flops / seconds / 1e9
        torch_by_rows[m] = flops / torch_seconds / 1e9
    return {"gflops": max(by_rows.values()), "by_rows": by_rows,
            "torch_gflops": max(torch_by_rows.values()), "torch_by_rows": torch_by_rows}
