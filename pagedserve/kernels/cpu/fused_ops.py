"""Fused element-wise ops for the CPU (fused_ops_cpu.cpp), called through ctypes.

One pass each for RMSNorm (with the residual add before it), SiLU·mul, rotary embedding with the
K/V cache write, and argmax; torch needs 3 to 14 ops for each. `usable(x)` says whether a tensor
can take them: float32 or bfloat16 (rounded between ops as torch's bfloat16 ops round), on the
CPU, and the library built (PAGEDSERVE_CPU_KERNELS=0 or a missing compiler leave the model on its
torch ops, which compute the same thing).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedserve.kernels.cpu import build as native_build

_SRC = Path(__file__).parent / "fused_ops_cpu.cpp"
# no contraction into fused multiply-adds: products and sums are rounded as torch rounds them
_FLAGS = native_build.BASE_FLAGS + ["-ffp-contract=off"]
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_native = native_build.NativeLibrary(_SRC, _FLAGS, "libpagedserve_ops.so", {
    **{f"rms_norm_{t}": (None, [_P, _I, _P, _P, _P, _I, _I, _I, _F, _N]) for t in ("f32", "bf16")},
    **{f"silu_mul_{t}": (None, [_P, _P, _I, _I, _N]) for t in ("f32", "bf16")},
    **{f"rope_qkv_{t}": (None, [_P] * 8 + [_I] * 4 + [_N]) for t in ("f32", "bf16")},
    **{f"argmax_{t}": (None, [_P, _I, _I, _P, _N]) for t in ("f32", "bf16")},
}, "fused CPU ops", "using torch ops")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _fn(name: str, dtype: torch.dtype):
    # load(), not .lib: a caller that skipped usable() (NativeGateUp's fallback) still gets the library
    return getattr(_native.load(), f"{name}_{_SUFFIX[dtype]}")


def load():
    """The loaded library, or None (the reason logged once) when it cannot be built."""
    return _native.load()


def usable(x: torch.Tensor) -> bool:
    return x.dtype in _SUFFIX and x.device.type == "cpu" and load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x [T, H]. With `residual` [T, H] (contiguous),
    first residual += x in place and normalise the sum instead."""
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    _fn("rms_norm", x.dtype)(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                      weight.data_ptr(), out.data_ptr(), h, t, h, eps, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = cat(gate, up) → [T, I]."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


def rope_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
             num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate q and k of qkv [T, (H + 2 KVH) D] at `positions` (rotate-half form, float32 tables [P, D]);
    write k and v into the caches [slots, KVH, D] at `slot_mapping`; return q [T, H, D]."""
    qkv = qkv.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype and cos.dtype == sin.dtype == torch.float32
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype)
    _fn("rope_qkv", qkv.dtype)(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                      q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, num_heads, num_kv_heads, head_dim,
                      torch.get_num_threads())
    return q


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of x [R, V] (first index on ties, NaN largest, as torch.argmax); torch's own
    where the native ops cannot take x."""
    if not usable(x):
        return x.argmax(dim=-1)
    x = x.contiguous()
    r, v = x.shape
    out = torch.empty(r, dtype=torch.int64)
    _fn("argmax", x.dtype)(x.data_ptr(), r, v, out.data_ptr(), torch.get_num_threads())
    return out
