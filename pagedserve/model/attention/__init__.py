"""Attention backends: how attention reads and writes the paged KV cache.

A backend is chosen once at start-up (`select_backend`) and logged. The portable torch backend
runs everywhere; CUDA kernels (flash-attn, Triton) plug in behind the same `forward` signature.
"""
from pagedserve.model.attention.metadata import AttentionMetadata  # noqa: F401
from pagedserve.model.attention.torch_backend import TorchAttentionBackend


def select_backend(device) -> "TorchAttentionBackend":
    return TorchAttentionBackend()
