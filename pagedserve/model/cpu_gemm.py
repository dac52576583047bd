"""Float32 linear layers on our own AVX2 GEMM (csrc/gemm_cpu.cpp), called through ctypes.

The weight is packed once into 16-column panels; each call packs the activations into 6-row
panels and runs a 6×16 register-tile kernel. On the decoder's shapes this measured 1.1-1.3× the
rate of oneDNN with a prepacked weight (benchmarks/cpu_gemm_ab.py). `usable()` is False where the
library can't be built (no compiler, PAGEDSERVE_CPU_KERNELS=0) or the CPU lacks AVX2/FMA; the
caller then keeps oneDNN or torch's linear.
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
    "fma_peak_gflops": (ctypes.c_double, [_N]),
}, "native CPU GEMM", "using oneDNN / torch linear")


def usable() -> bool:
    lib = _native.load()
    return lib is not None and bool(lib.gemm_f32_supported())


def fma_peak_gflops(threads: int) -> float:
    """This CPU's float32 FMA peak over `threads` threads, measured now (~0.1 s): the bound no GEMM passes."""
    return _native.load().fma_peak_gflops(threads)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 → its packed panels (a flat float32 tensor)."""
    w = weight.detach().contiguous()
    n, k = w.shape
    packed = torch.empty(_native.lib.gemm_f32_packed_size(n, k), dtype=torch.float32)
    assert packed.data_ptr() % 32 == 0  # the kernel reads panels with aligned loads; torch aligns to 64
    _native.lib.gemm_f32_pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias) → [..., N] with W packed by `pack_weight`."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if x2.dtype != torch.float32 or x2.stride(-1) != 1 or (m > 1 and x2.stride(0) < k):
        x2 = x2.float().contiguous()
    out = torch.empty((m, out_features), dtype=torch.float32)
    _native.lib.gemm_f32(x2.data_ptr(), x2.stride(0), m, k, packed.data_ptr(), out_features,
                         bias.data_ptr() if bias is not None else None, out.data_ptr(), out_features,
                         torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


class NativeLinear(nn.Module):
    """An nn.Linear (float32, CPU) whose weight lives packed for the native GEMM."""

    def __init__(self, linear_layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear_layer.in_features, linear_layer.out_features
        self.packed = pack_weight(linear_layer.weight)
        self.bias = linear_layer.bias.detach().contiguous() if linear_layer.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
