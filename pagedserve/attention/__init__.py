"""Attention backends: how attention reads and writes the paged KV cache.

A backend is chosen once at start-up (`select_backend`) and logged. The portable torch backend
runs everywhere; CUDA kernels (flash-attn, Triton) plug in behind the same `forward` signature.
A backend with `needs_block_tables = True` gets kernel-style metadata (block_tables, seq_lens,
query_start_loc, block_size) from the model runner.

Choice: env PAGEDSERVE_ATTENTION_BACKEND = torch | triton | flash-attn picks one explicitly (an
unavailable one is a ConfigError). Default: on CUDA Triton when importable, else torch (flash-attn
only when named, until it has been verified on a GPU); on the CPU torch.
"""
from __future__ import annotations

import logging
import os

import torch

from pagedserve.errors import ConfigError
from pagedserve.attention.metadata import AttentionMetadata  # noqa: F401
from pagedserve.attention.torch_backend import TorchAttentionBackend

log = logging.getLogger("pagedserve")

ENV_VAR = "PAGEDSERVE_ATTENTION_BACKEND"
CHOICES = ("torch", "triton", "flash-attn")


def _triton(device: torch.device, block_size):
    from pagedserve.kernels.triton import paged_attention as tk
    from pagedserve.attention.triton_backend import TritonAttentionBackend

    if not tk.triton_available():
        raise RuntimeError("triton is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the slow CPU "
                           f"interpreter); the engine runs on {device}")
    return TritonAttentionBackend(block_size)


def _flash(device: torch.device, block_size):
    from pagedserve.attention.flash_attn_backend import FlashAttnBackend

    if device.type != "cuda":
        raise RuntimeError(f"flash-attn needs a CUDA device; the engine runs on {device}")
    return FlashAttnBackend(block_size)


def select_backend(device, block_size: int | None = None):
    device = torch.device(device)
    choice = os.environ.get(ENV_VAR, "").strip().lower().replace("_", "-")
    if choice in ("flash-attention", "flashattn", "flash"):
        choice = "flash-attn"
    if choice:
        if choice not in CHOICES:
            raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a backend; use one of {', '.join(CHOICES)}")
        if choice == "torch":
            return TorchAttentionBackend()
        try:
            return (_triton if choice == "triton" else _flash)(device, block_size)
        except RuntimeError as e:
            raise ConfigError(f"{ENV_VAR}={choice} is not available: {e}. Unset it (automatic choice) or "
                              f"set it to torch") from e
    if device.type != "cuda":
        return TorchAttentionBackend()
    # Triton first: its kernels are tested (interpreter in CI); the flash-attn path has not run on a
    # GPU yet, so it is used only when asked for by name.
    for make in (_triton,):
        try:
            return make(device, block_size)
        except RuntimeError as e:
            log.debug("attention backend not usable: %s", e)
    return TorchAttentionBackend()
