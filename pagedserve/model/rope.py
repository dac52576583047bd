"""Rotary position embeddings: cos/sin tables indexed by absolute position.

The tables are computed in float32 exactly as transformers does (inverse frequencies times
positions, duplicated halves), so positions rotate identically and outputs match bit for bit.
"""
from __future__ import annotations

import math

import torch

from pagedserve.errors import ConfigError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # computed on the CPU whatever device the model is being built on (loader._build moves it
        # after): the same float32 tables everywhere, and no meta-device arithmetic, which would
        # import torch._dynamo (seconds of start-up)
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(head_dim, theta, scaling)
            pos = torch.arange(max_positions, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d] → rotated copies."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : self.half]
        x2 = x[..., self.half:]
        return torch.cat((-x2, x1), dim=-1)
