"""Float32 and bfloat16 linear layers on our own GEMM (gemm_cpu.cpp), called through ctypes.

The weight is packed once into 16-column panels; each call packs the activations into row panels
and runs a register-tile kernel: 6×16 on AVX2 CPUs, 8×48 on AVX-512 ones
(gemm_tile_avx512.h). On the decoder's shapes this measured 1.1-1.3× the rate of oneDNN with a
prepacked weight on an AVX2 machine and about the same as it on an AVX-512 Xeon
(benchmarks/cpu_gemm_ab.py). `usable()` is False where the library can't be built (no compiler,
PAGEDSERVE_CPU_KERNELS=0) or the CPU lacks AVX2/FMA; the caller then keeps oneDNN or torch's
linear. `set_avx512(False)` keeps the AVX2 tile on an AVX-512 CPU (for A/B runs).

bfloat16 weights stay bfloat16 in their panels (half the bytes) and are widened to float32 inside
the kernel; products and sums are float32 and the output is rounded to bfloat16 once. Where the
CPU has no AMX this beats torch's bfloat16 linear: AVX2-only CPUs run that through an emulated
path at a few GFLOP/s, 20× slower; AVX512-BF16 Xeons run oneDNN's vdpbf16ps GEMM at ~0.75× our
widening AVX-512 tile (their vdpbf16ps issues at half the float32 FMA's rate). Where vdpbf16ps
issues as often as an FMA (AMD Zen 4 and later, told by CPUID in the library) bfloat16 activations go
to a vdpbf16ps tile instead, 1.6-1.7× the widening one there (`bf16_dot()`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from pagedserve.kernels.cpu import build as native_build

_SRC = Path(__file__).parent / "gemm_cpu.cpp"
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# no contraction into fused multiply-adds: the gate/up epilogue's SiLU must round as the fused ops'
# does (silu.h); the tiles' own FMAs are explicit
_native = native_build.NativeLibrary(_SRC, native_build.BASE_FLAGS + ["-ffp-contract=off"], "libpagedserve_gemm.so", {
    "gemm_f32_supported": (_N, []),
    "gemm_f32_packed_size": (_I, [_I, _I]),
    "gemm_f32_pack": (None, [_P, _I, _I, _P, _N]),
    "gemm_f32": (None, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "gemm_bf16_packed_size": (_I, [_I, _I]),
    "gemm_bf16_pack": (None, [_P, _I, _I, _P, _N]),
    "gemm_bf16": (None, [_P, _N, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "fma_peak_gflops": (ctypes.c_double, [_N]),
    "gemm_bf16kp_supported": (_N, []),
    "gemm_bf16kp_packed_size": (_I, [_I, _I]),
    "gemm_bf16kp_pack": (None, [_P, _I, _I, _P, _N]),
    "gemm_bf16kp": (None, [_P, _N, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "gemm_f32_vector_bits": (_N, []),
    "gemm_f32_set_avx512": (_N, [_N]),
    "gemm_bf16kp_set_dot": (_N, [_N]),
    "gemm_bf16kp_dot": (_N, []),
    "gemm_bf16kp_bf16out_takes": (_N, [_I]),
    "gemm_bf16kp_bf16out": (_N, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _N]),
    "gemm_silu_mul_takes": (_N, [_I, _I]),
    "gemm_f32_silu_mul": (_N, [_P, _I, _I, _I, _P, _I, _P, _I, _N]),
    "gemm_bf16kp_silu_mul": (_N, [_P, _I, _I, _I, _P, _I, _P, _I, _N]),
    "greedy_screen_argmax": (_I, [_P, _I, _P, _I, _I, _I, _P, _P, _N, _I, _P, ctypes.c_double, _P, _N]),
    "greedy_screen_int8_takes": (_N, [_I]),
    "greedy_screen_int8_packed_size": (_I, [_I, _I]),
    "greedy_screen_int8_pack": (None, [_P, _I, _I, _P, _N]),
    "greedy_screen_int8_argmax": (_I, [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_double, _P, _I, _P,
                                       ctypes.c_double, _P, _N]),
}, "native CPU GEMM", "using oneDNN / torch linear")


def check(status: int, fn: str, k: int) -> int:
    """A native call's status as a Python exception: the library refuses a shape it cannot take
    (returning a negative status, nothing computed) instead of aborting the process."""
    if status < 0:
        raise RuntimeError(f"native CPU GEMM: {fn} does not take K={k} (the caller should have checked)")
    return status


def usable() -> bool:
    lib = _native.load()
    return lib is not None and bool(lib.gemm_f32_supported())


def vector_bits() -> int:
    """The width of the float32 tile in use: 512 on CPUs with AVX-512, else 256 (AVX2)."""
    return _native.load().gemm_f32_vector_bits()


def set_avx512(on: bool) -> int:
    """Runs float32 GEMMs on the AVX-512 tile (if the CPU has it) or on the AVX2 one; returns the
    width now in use. For A/B runs and tests: both tiles read the same packed weights."""
    return _native.load().gemm_f32_set_avx512(int(on))


def fma_peak_gflops(threads: int) -> float:
    """This CPU's float32 FMA peak over `threads` threads, measured now (~0.1 s): the bound no GEMM passes."""
    return _native.load().fma_peak_gflops(threads)


DTYPES = (torch.float32, torch.bfloat16)  # what pack_weight takes


def amx() -> bool:
    """Whether this CPU has AMX tiles, whose bfloat16 matrix units oneDNN uses: there bfloat16
    layers go to oneDNN prepacked (cpu_linear), not to the native GEMM."""
    return torch.cpu._is_amx_tile_supported()


def bf16_k_pairs() -> bool:
    """Whether bfloat16 weights run on the AVX-512 tile (packed in k pairs) rather than the AVX2
    one (interleaved columns): where the CPU has AVX-512, unless set_avx512(False) chose the AVX2 tile."""
    lib = _native.load()
    return lib is not None and bool(lib.gemm_bf16kp_supported()) and lib.gemm_f32_vector_bits() == 512


def bf16_dot() -> bool:
    """Whether bfloat16 GEMMs on k-pair panels with bfloat16 activations run the vdpbf16ps tile
    (AVX512-BF16 on AMD cores, Zen 4 and later, where it issues as often as an FMA) rather
    than widening the weights to float32 FMAs."""
    return bf16_k_pairs() and bool(_native.lib.gemm_bf16kp_dot())


def set_bf16_dot(mode: bool | None) -> bool:
    """Forces the vdpbf16ps tile on (True, where the CPU has it) or off (False), or back to the
    CPUID's choice (None); returns whether it is now in use. For A/B runs and tests."""
    return bool(_native.load().gemm_bf16kp_set_dot(-1 if mode is None else int(mode)))


def fast_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes for which the native GEMM is this CPU's fastest linear."""
    return (torch.float32,) if amx() else DTYPES


class PackedWeight:
    """A weight packed for the native GEMM: the flat panels (a tensor of the weight's dtype), its
    shape, and for bfloat16 which of the two layouts it is in (k pairs for the AVX-512 tile, or
    interleaved columns for the AVX2 one)."""

    def __init__(self, weight: torch.Tensor, k_pairs: bool | None = None):
        w = weight.detach().contiguous()
        if w.dtype not in DTYPES:
            raise TypeError(f"the native GEMM takes float32 or bfloat16 weights, not {w.dtype}")
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        bf16 = w.dtype == torch.bfloat16
        self.k_pairs = bf16 and (bf16_k_pairs() if k_pairs is None else k_pairs)
        lib = _native.lib
        size_fn, pack_fn = ((lib.gemm_bf16kp_packed_size, lib.gemm_bf16kp_pack) if self.k_pairs else
                            (lib.gemm_bf16_packed_size, lib.gemm_bf16_pack) if bf16 else
                            (lib.gemm_f32_packed_size, lib.gemm_f32_pack))
        self.panels = torch.empty(size_fn(*w.shape), dtype=w.dtype)
        assert self.panels.data_ptr() % 64 == 0  # the kernels read panels with aligned loads; torch aligns to 64
        pack_fn(w.data_ptr(), *w.shape, self.panels.data_ptr(), torch.get_num_threads())
        # bfloat16 activations on these panels can be stored as bfloat16 straight from the tiles
        self.bf16_out = self.k_pairs and bool(lib.gemm_bf16kp_bf16out_takes(self.in_features))


def pack_weight(weight: torch.Tensor, k_pairs: bool | None = None) -> PackedWeight:
    """weight [N, K] float32 or bfloat16 → its packed panels. k_pairs (bfloat16 only) picks the
    layout, and with it the tile; by default the AVX-512 one where it runs (see bf16_k_pairs)."""
    return PackedWeight(weight, k_pairs)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
           float32_out: bool = False) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias) → [..., N] with W packed by `pack_weight`.

    The result has the weight's dtype, or float32 sums unrounded with float32_out; x may be
    float32 or bfloat16 (others are converted), and a bias is float32 (bfloat16 weights: see
    NativeLinear, which keeps it widened)."""
    k, out_features = x.shape[-1], packed.out_features
    if k != packed.in_features:
        raise ValueError(f"x has {k} features, the weight takes {packed.in_features}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    bf16_w = packed.dtype == torch.bfloat16
    x_ok = x2.dtype == torch.float32 or (bf16_w and x2.dtype == torch.bfloat16)
    if not x_ok or x2.stride(-1) != 1 or (m > 1 and x2.stride(0) < k):
        x2 = x2.to(torch.bfloat16 if bf16_w and x2.dtype == torch.bfloat16 else torch.float32).contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    b = bias.data_ptr() if bias is not None else None
    lib = _native.lib
    if packed.bf16_out and x2.dtype == torch.bfloat16 and not float32_out:
        # rounded to bfloat16 as each tile is stored: no float32 out to write and convert
        out = torch.empty((m, out_features), dtype=torch.bfloat16)
        check(lib.gemm_bf16kp_bf16out(x2.data_ptr(), x2.stride(0), m, k, packed.panels.data_ptr(), out_features, b,
                                      out.data_ptr(), out_features, torch.get_num_threads()), "gemm_bf16kp_bf16out", k)
        return out.view(*x.shape[:-1], out_features)
    out = torch.empty((m, out_features), dtype=torch.float32)
    if bf16_w:
        fn = lib.gemm_bf16kp if packed.k_pairs else lib.gemm_bf16
        fn(x2.data_ptr(), int(x2.dtype == torch.bfloat16), x2.stride(0), m, k, packed.panels.data_ptr(),
           out_features, b, out.data_ptr(), out_features, torch.get_num_threads())
        if not float32_out:
            out = out.to(torch.bfloat16)
    else:
        lib.gemm_f32(x2.data_ptr(), x2.stride(0), m, k, packed.panels.data_ptr(), out_features, b,
                     out.data_ptr(), out_features, torch.get_num_threads())
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
        return linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NativeGateUp(nn.Module):
    """The fused gate/up projection (an nn.Linear [2I, K] = [gate | up], no bias) packed for the
    native GEMM so that `silu_mul(x)` stores silu(gate) · up [.., I] straight from the tiles: the
    [.., 2I] product is never written and read back (the MLP's SiLU pass is gone). The rows are
    packed 8 gate rows, the same 8 up rows, and so on, so each 16-column tile panel holds matching
    halves. Bit-identical to gate_up followed by cpu_fused.silu_mul (same sums, same SiLU code).
    float32 x on float32 weights, bfloat16 x on k-pair bfloat16 weights (else the two steps)."""

    def __init__(self, linear_layer: nn.Linear):
        super().__init__()
        n, k = linear_layer.out_features, linear_layer.in_features
        lib = _native.load()
        if lib is None:
            raise ValueError(f"native CPU GEMM unavailable: {_native.failure_reason}")
        if linear_layer.bias is not None or not lib.gemm_silu_mul_takes(n, k):
            raise ValueError(f"the gate/up epilogue takes no bias, 2I a multiple of 16 and K in one k block, "
                             f"not [{n}, {k}]")
        self.in_features, self.out_features = k, n
        order = torch.arange(n).view(2, n // 16, 8).transpose(0, 1).reshape(-1)
        self.packed = pack_weight(linear_layer.weight.detach()[order])
        self._unorder = torch.argsort(order)
        self._fn = ("gemm_f32_silu_mul" if self.packed.dtype == torch.float32 else
                    "gemm_bf16kp_silu_mul" if self.packed.k_pairs else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The plain [gate | up] product (for callers other than the MLP)."""
        return linear(x, self.packed)[..., self._unorder]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of x [.., K] → [.., I], in the weight's dtype."""
        x2 = x.reshape(-1, self.in_features)
        if self._fn is None or x2.dtype != self.packed.dtype or x2.stride(-1) != 1 or x2.stride(0) < self.in_features:
            from pagedserve.kernels.cpu import fused_ops as cpu_fused

            return cpu_fused.silu_mul(self.forward(x2)).view(*x.shape[:-1], self.out_features // 2)
        out = torch.empty((x2.shape[0], self.out_features // 2), dtype=x2.dtype)
        check(getattr(_native.lib, self._fn)(x2.data_ptr(), x2.stride(0), x2.shape[0], self.in_features,
                                             self.packed.panels.data_ptr(), self.out_features, out.data_ptr(),
                                             out.shape[1], torch.get_num_threads()), self._fn, self.in_features)
        return out.view(*x.shape[:-1], self.out_features // 2)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, silu_mul epilogue"
