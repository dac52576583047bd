"""ctypes binding of csrc/quant_linear_cpu.cpp: linears computed from grouped integer weights.

Built like the engine's other native libraries (kernels/cpu/build.py: on first use, cached per
source, flags and CPU). `load()` is None without a compiler or with PAGEDSERVE_CPU_KERNELS=0; the
quantized linears then dequantize with torch ops (grouped.py), slower but the same arithmetic.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from pagedserve.kernels.cpu import build as native_build

_SRC = Path(__file__).parent / "csrc" / "quant_linear_cpu.cpp"
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_native = native_build.NativeLibrary(_SRC, native_build.BASE_FLAGS, "libpagedserve_quant.so", {
    "quant_linear_simd": (_N, []),
    "quant_linear_rows": (None, [_P, _I, _I, _P, _N, _I, _I, _I, _P, _P, _P, _P, _I, _N]),
    "quant_dequant": (None, [_P, _N, _I, _I, _I, _P, _P, _P, _N]),
    "w8a8_linear": (None, [_P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _N]),
}, "quantized-linear CPU kernels", "quantized linears dequantize with torch ops")


def load():
    """The loaded library, or None (the reason logged once)."""
    return _native.load()


def failure_reason() -> str | None:
    return _native.failure_reason
