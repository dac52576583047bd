"""Attention backends: how attention reads and writes the paged KV cache.

A backend is chosen once at start-up (`select_backend`, from EngineConfig.attention_backend) and
logged; each builds its own metadata from the runner's flat batch (`build_metadata`) and offers
`forward(q, k, v, k_cache, v_cache, meta, scale)`.

- cpu: the native paged kernel (attention/cpu_backend.py); the CPU default where it builds.
- torch: the portable SDPA path; the CPU fallback (kernels off, no compiler, float16).
- triton: pagedserve's Triton kernels; the CUDA default when triton imports.
- flash-attn: only when named, until it has been verified on a GPU.
A backend named explicitly that cannot run is a ConfigError.
"""
from __future__ import annotations

import logging
import os

import torch

from pagedserve.attention.metadata import AttentionMetadata, FlatBatch  # noqa: F401
from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.errors import ConfigError

log = logging.getLogger("pagedserve")


def _cpu(device: torch.device, block_size, dtype, cpu_kernels: bool):
    from pagedserve.attention.cpu_backend import CpuPagedAttentionBackend
    from pagedserve.kernels.cpu import paged_attention

    if device.type != "cpu":
        raise RuntimeError(f"the native paged kernel runs on the CPU; the engine runs on {device}")
    if not cpu_kernels:
        raise RuntimeError("native CPU kernels are off (cpu_kernels=False / PAGEDSERVE_CPU_KERNELS=0)")
    if not paged_attention.supports(dtype):
        raise RuntimeError(f"the native paged kernel takes float32 or bfloat16, not {dtype}")
    if paged_attention.load() is None:
        raise RuntimeError(f"the native paged kernel did not build ({paged_attention.failure_reason()})")
    return CpuPagedAttentionBackend()


def _triton(device: torch.device, block_size, dtype, cpu_kernels: bool):
    from pagedserve.attention.triton_backend import TritonAttentionBackend
    from pagedserve.kernels.triton import paged_attention as tk

    if not tk.triton_available():
        raise RuntimeError("triton is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the slow CPU "
                           f"interpreter); the engine runs on {device}")
    return TritonAttentionBackend(block_size)


def _flash(device: torch.device, block_size, dtype, cpu_kernels: bool):
    from pagedserve.attention.flash_attn_backend import FlashAttnBackend

    if device.type != "cuda":
        raise RuntimeError(f"flash-attn needs a CUDA device; the engine runs on {device}")
    return FlashAttnBackend(block_size)


_MAKERS = {"cpu": _cpu, "triton": _triton, "flash-attn": _flash,
           "torch": lambda device, block_size, dtype, cpu_kernels: TorchAttentionBackend()}


def select_backend(device, block_size: int | None = None, dtype: torch.dtype = torch.float32,
                   choice: str = "auto", cpu_kernels: bool = True):
    """The attention backend for this engine: `choice` (EngineConfig.attention_backend) or, for
    auto, the native CPU kernel on the CPU and Triton on CUDA, each falling back to torch."""
    device = torch.device(device)
    if choice != "auto":
        try:
            return _MAKERS[choice](device, block_size, dtype, cpu_kernels)
        except RuntimeError as e:
            raise ConfigError(f"attention backend {choice} is not available: {e}. Use the automatic choice "
                              f"(unset PAGEDSERVE_ATTENTION_BACKEND) or torch") from e
    # Triton first on CUDA: its kernels are tested (interpreter in CI); flash-attn only by name
    make = _cpu if device.type == "cpu" else _triton if device.type == "cuda" else None
    if make is not None:
        try:
            return make(device, block_size, dtype, cpu_kernels)
        except RuntimeError as e:
            log.info("attention: torch SDPA path (%s)", e)
    return TorchAttentionBackend()
