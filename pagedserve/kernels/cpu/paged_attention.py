"""Native CPU attention kernels: a small C++ library built on first use and called via ctypes.

The paged kernel reads K/V rows where they lie in the block pool, for the whole batch: decodes,
fresh prompts, and prompt chunks with earlier context (chunked prefill, prefix-cache hits). The
portable torch path must first gather every decode's context into a padded copy, per layer and
step, which at large batches costs more than the attention itself. The library is built on first
use (kernels/cpu/build.py). Without a compiler, or with PAGEDSERVE_CPU_KERNELS=0, the engine keeps
the torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedserve.kernels.cpu import build as native_build

_SRC = Path(__file__).parent / "paged_attention_cpu.cpp"
# fast-math-style reassociation for the dot products; not -ffinite-math (softmax starts at -inf)
_FLAGS = native_build.BASE_FLAGS + ["-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
                                    "-freciprocal-math"]
_FN = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
_native = native_build.NativeLibrary(
    _SRC, _FLAGS, "libpagedserve_cpu.so",
    {**{name: (None, _ARGS) for name in _FN.values()}, "paged_attention_vectorized": (ctypes.c_int, []),
     "paged_attention_set_decode_kernel": (ctypes.c_int, [ctypes.c_int]),
     "paged_attention_set_amx": (ctypes.c_int, [ctypes.c_int]),
     "paged_attention_set_bf16_dot": (ctypes.c_int, [ctypes.c_int])},
    "CPU attention kernel", "using the torch gather path")


_bf16_dot: bool | None = None  # the dot walk's state, once load() has set its default


def load():
    """The loaded library, or None (the reason logged once) when it cannot be built."""
    lib = _native.load()
    if lib is not None and _bf16_dot is None:
        set_bf16_dot(None)
    return lib


def failure_reason() -> str | None:
    return _native.failure_reason


def supports(dtype: torch.dtype) -> bool:
    return dtype in _FN


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, q_starts: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's newest tokens over its whole paged context.

    q [T, H, D]: sequence b owns rows q_starts[b]:q_starts[b+1], the last of its seq_lens[b]
    context positions (whose K/V are already in the cache); caches [num_blocks, block_size,
    kv_heads, D]; block_tables [B, max_blocks], seq_lens [B], q_starts [B+1], all int64 → [T, H, D].
    """
    lib = load()
    q = q.contiguous()
    out = torch.empty_like(q)
    _, h, d = q.shape
    _, bs, kvh, _ = key_cache.shape
    getattr(lib, _FN[q.dtype])(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                               seq_lens.data_ptr(), q_starts.data_ptr(), out.data_ptr(), seq_lens.shape[0], h, kvh, d,
                               bs, block_tables.shape[1], scale, torch.get_num_threads())
    return out


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] → [B, H, D]."""
    q_starts = torch.arange(q.shape[0] + 1, dtype=torch.int64)
    return paged_attention(q, key_cache, value_cache, block_tables, seq_lens, q_starts, scale)


def set_decode_kernel(on: bool) -> bool:
    """Decodes on the AVX-512 decode kernel (True, the default) or the row path (False), for A/B
    runs and tests. Returns whether this build has the decode kernel at all."""
    return bool(load().paged_attention_set_decode_kernel(int(on)))


def set_amx(on: bool) -> bool:
    """bfloat16 prompt chunks on AMX tiles (True, the default, where the CPU has AMX-BF16 and the
    OS grants the tiles) or on the AVX-512 tiled path (False), for A/B runs and tests. Returns
    whether this build and machine have the AMX path at all."""
    return bool(load().paged_attention_set_amx(int(on)))


def set_bf16_dot(on: bool | None) -> bool:
    """bfloat16 prompt chunks and shared-prefix passes of the tiled path, and the decode kernel's
    scores, on vdpbf16ps (True, where the CPU has AVX512-BF16) or on float32 FMAs (False); None
    restores the default, which follows
    the GEMM library's CPUID rule (cpu_gemm.bf16_dot(): on where vdpbf16ps issues as often as an FMA,
    AMD Zen 4). For A/B runs and tests. Returns whether the walk is now in use."""
    global _bf16_dot
    if on is None:
        from pagedserve.kernels.cpu import gemm as cpu_gemm

        on = cpu_gemm.bf16_dot()
    lib = _native.load()
    _bf16_dot = bool(lib is not None and lib.paged_attention_set_bf16_dot(int(on)) and on)
    return _bf16_dot


def bf16_dot() -> bool:
    """Whether bfloat16 attention runs its products on vdpbf16ps now (see set_bf16_dot)."""
    load()
    return bool(_bf16_dot)
