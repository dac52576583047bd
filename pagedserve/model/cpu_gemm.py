"""Float32 and bfloat16 linear layers on our own AVX2 GEMM (csrc/gemm_cpu.cpp), called through ctypes.

The weight is packed once into 16-column panels; each call packs the activations into 6-row
panels and runs a 6×16 register-tile kernel. On the decoder's shapes this measured 1.1-1.3× the
rate of oneDNN with a prepacked weight (benchmarks/cpu_gemm_ab.py). `usable()` is False where the
library can't be built (no compiler, PAGEDSERVE_CPU_KERNELS=0) or the CPU lacks AVX2/FMA; the
caller then keeps oneDNN or torch's linear.

bfloat16 weights stay bfloat16 in their panels (half the bytes) and are widened to float32 inside
the kernel; products and sums are float32 and the output is rounded to bfloat16 once. CPUs
without bfloat16 units (AVX2-only, most AMD before Zen 4) otherwise run torch's bfloat16 linear
through an emulated path at a few GFLOP/s, 20× slower than this.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from pagedserve.model import native_build

_SRC = Path(__file__).parent / "csrc" / "gemm_cpu.cpp"
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_native = native_build.NativeLibrary(_SRC, native_build.BASE_FLAGS, "libpagedserve_gemm.so", {
    "gemm_f32_supported": (_N, []),
    "gemm_f32_packed_size": (_I, [_I, _I]),
    "gemm_f32_pack": (None, [_P, _I, _I, _P, _N]),
    "gemm_f32": (None, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "gemm_bf16_packed_size": (_I, [_I, _I]),
    "gemm_bf16_pack": (None, [_P, _I, _I, _P, _N]),
    "gemm_bf16": (None, [_P, _N, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "fma_peak_gflops": (ctypes.c_double, [_N]),
}, "native CPU GEMM", "using oneDNN / torch linear")


def usable() -> bool:
    lib = _native.load()
    return lib is not None and bool(lib.gemm_f32_supported())


def fma_peak_gflops(threads: int) -> float:
    """This CPU's float32 FMA peak over `threads` threads, measured now (~0.1 s): the bound no GEMM passes."""
    return _native.load().fma_peak_gflops(threads)


DTYPES = (torch.float32, torch.bfloat16)  # what pack_weight takes


def bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), where oneDNN's
    bfloat16 GEMM behind torch's own linear beats our float32 FMAs on widened weights."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def fast_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes for which the native GEMM is this CPU's fastest linear."""
    return DTYPES if not bf16_units() else (torch.float32,)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 or bfloat16 → its packed panels (a flat tensor of the same dtype)."""
    w = weight.detach().contiguous()
    if w.dtype not in DTYPES:
        raise TypeError(f"the native GEMM takes float32 or bfloat16 weights, not {w.dtype}")
    n, k = w.shape
    bf16 = w.dtype == torch.bfloat16
    size = (_native.lib.gemm_bf16_packed_size if bf16 else _native.lib.gemm_f32_packed_size)(n, k)
    packed = torch.empty(size, dtype=w.dtype)
    assert packed.data_ptr() % 32 == 0  # the kernel reads panels with aligned loads; torch aligns to 64
    (_native.lib.gemm_bf16_pack if bf16 else _native.lib.gemm_f32_pack)(w.data_ptr(), n, k, packed.data_ptr(),
                                                                         torch.get_num_threads())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias) → [..., N] with W packed by `pack_weight`.

    The result has the weight's dtype; x may be float32 or bfloat16 (others are converted), and a
    bias is float32 (bfloat16 weights: see NativeLinear, which keeps it widened)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    bf16_w = packed.dtype == torch.bfloat16
    x_ok = x2.dtype == torch.float32 or (bf16_w and x2.dtype == torch.bfloat16)
    if not x_ok or x2.stride(-1) != 1 or (m > 1 and x2.stride(0) < k):
        x2 = x2.to(torch.bfloat16 if bf16_w and x2.dtype == torch.bfloat16 else torch.float32).contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    out = torch.empty((m, out_features), dtype=torch.float32)
    b = bias.data_ptr() if bias is not None else None
    if bf16_w:
        _native.lib.gemm_bf16(x2.data_ptr(), int(x2.dtype == torch.bfloat16), x2.stride(0), m, k, packed.data_ptr(),
                              out_features, b, out.data_ptr(), out_features, torch.get_num_threads())
        out = out.to(torch.bfloat16)
    else:
        _native.lib.gemm_f32(x2.data_ptr(), x2.stride(0), m, k, packed.data_ptr(), out_features, b, out.data_ptr(),
                             out_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


class NativeLinear(nn.Module):
    """An nn.Linear (float32 or bfloat16, CPU) whose weight lives packed for the native GEMM."""

    def __init__(self, linear_layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear_layer.in_features, linear_layer.out_features
        self.packed = pack_weight(linear_layer.weight)
        # the kernel adds a float32 bias to float32 sums; widening a bfloat16 bias is exact
        self.bias = linear_layer.bias.detach().float().contiguous() if linear_layer.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
