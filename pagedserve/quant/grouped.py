"""The grouped-integer weight layout every integer format is loaded into, and its linear.

A weight W [N, K] is kept as integers q with a float32 scale s and an optional float32 offset m per
output row and group of `group` input columns:  W[n, k] = q[n, k] · s[n, k // group] + m[n, k // group].
  * bits 8: q int8 [N, K];
  * bits 4: q 0..15 packed two per byte, [N, K / 2], in blocks of 32 columns whose byte j holds
    column j (low nibble) and column j + 16 (high nibble): GGUF's Q4_0 / Q4_1 order.
Optionally `perm` (GPTQ act-order): the layer computes x[:, perm] · Wᵀ, the columns having been
sorted by group at load so that every group is contiguous.

Each format's file (awq.py, gptq.py, gguf.py, ...) turns its checkpoint tensors into this layout;
the loaders fuse q/k/v and gate/up by stacking along N. The product runs in the native kernel
(csrc/quant_linear_cpu.cpp) on the CPU: straight from q for decode-sized batches, through a
float32 dequantized copy of the weight for larger ones (a dense GEMM then pays off). Without the
library, or on another device, the weight is dequantized with torch ops per call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.quant import cpu_kernels

# Batches up to this many rows run the kernel that reads q directly (each weight group widened once
# for up to 4 rows); larger ones dequantize once and run a dense GEMM (benchmarks/quant_linear_ab.py).
DIRECT_MAX_ROWS = int(os.environ.get("PAGEDSERVE_QUANT_DIRECT_ROWS", "8"))


@dataclass
class GroupedWeight:
    q: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K/2] (bits 4)
    scales: torch.Tensor  # float32 [N, G]
    offsets: torch.Tensor | None  # float32 [N, G] or None (symmetric)
    bits: int
    group: int
    in_features: int
    perm: torch.Tensor | None = None  # int64 [K]: the layer reads x[:, perm]

    def __post_init__(self):
        n, k = self.out_features, self.in_features
        if self.bits not in (4, 8):
            raise ValueError(f"grouped weights are 4 or 8 bit, not {self.bits}")
        if self.bits == 4 and (k % 32 or self.group % 32):
            raise ValueError(f"4-bit grouped weights need in_features and group size multiples of 32 (got {k}, {self.group})")
        want_q = (n, k // 2 if self.bits == 4 else k)
        groups = -(-k // self.group)
        if tuple(self.q.shape) != want_q or tuple(self.scales.shape) != (n, groups):
            raise ValueError(f"grouped weight shapes q {tuple(self.q.shape)} scales {tuple(self.scales.shape)} "
                             f"do not match [{n}, {k}] with group {self.group}")
        if self.offsets is not None and self.offsets.shape != self.scales.shape:
            raise ValueError("offsets and scales differ in shape")
        self.q = self.q.contiguous()
        self.scales = self.scales.to(torch.float32).contiguous()
        if self.offsets is not None:
            self.offsets = self.offsets.to(torch.float32).contiguous()

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        extra = [self.scales, self.offsets, self.perm]
        return self.q.numel() * self.q.element_size() + sum(t.numel() * t.element_size() for t in extra if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (in the layer's column order: x[:, perm] meets it)."""
        n, k = self.out_features, self.in_features
        if self.bits == 4:
            blocks = self.q.view(n, k // 32, 16)
            ints = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, k)
        else:
            ints = self.q
        col_group = torch.arange(k) // self.group
        w = ints.to(torch.float32) * self.scales[:, col_group]
        if self.offsets is not None:
            w = w + self.offsets[:, col_group]
        return w

    @staticmethod
    def stack(parts: "list[GroupedWeight]") -> "GroupedWeight":
        """Fuse along the output dimension (q/k/v, gate/up); ValueError when the parts differ in layout."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group, p.in_features) != (first.bits, first.group, first.in_features):
                raise ValueError("parts differ in bits, group size or input width")
            if (p.offsets is None) != (first.offsets is None):
                raise ValueError("parts differ in having offsets")
            if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
                raise ValueError("parts have different act-order permutations")
        if len(parts) == 1:
            return first
        offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
        return GroupedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), offsets,
                             first.bits, first.group, first.in_features, first.perm)


def pack_nibbles(ints: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 → uint8 [N, K/2] in the 32-column block order above."""
    n, k = ints.shape
    b = ints.to(torch.uint8).view(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class GroupedLinear(nn.Module):
    """y = x · Wᵀ + b for a GroupedWeight W; x float32 or bfloat16 (computed in float32)."""

    def __init__(self, weight: GroupedWeight, bias: torch.Tensor | None, fmt: str):
        super().__init__()
        self.weight_q = weight
        self.bias = None if bias is None else bias.to(torch.float32).contiguous()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.format = fmt  # what the checkpoint called it, for logs ("gguf Q4_1", "awq", ...)

    @property
    def nbytes(self) -> int:
        return self.weight_q.nbytes + (self.bias.numel() * 4 if self.bias is not None else 0)

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{self.in_features} -> {self.out_features}, {self.format}, {w.bits}-bit, group {w.group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_q
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).to(torch.float32)
        if w.perm is not None:
            x2 = x2.index_select(1, w.perm)
        lib = cpu_kernels.load() if x.device.type == "cpu" else None
        if lib is None:
            y = F.linear(x2, w.dequantize().to(x2.device), self.bias)
        else:
            x2 = x2.contiguous()
            m = x2.shape[0]
            threads = torch.get_num_threads()
            off = w.offsets.data_ptr() if w.offsets is not None else None
            if m <= DIRECT_MAX_ROWS:
                y = torch.empty((m, w.out_features), dtype=torch.float32)
                lib.quant_linear_rows(x2.data_ptr(), x2.stride(0), m, w.q.data_ptr(), w.bits, w.out_features,
                                      w.in_features, w.group, w.scales.data_ptr(), off,
                                      self.bias.data_ptr() if self.bias is not None else None, y.data_ptr(),
                                      y.stride(0), threads)
            else:
                dense = torch.empty((w.out_features, w.in_features), dtype=torch.float32)
                lib.quant_dequant(w.q.data_ptr(), w.bits, w.out_features, w.in_features, w.group,
                                  w.scales.data_ptr(), off, dense.data_ptr(), threads)
                y = F.linear(x2, dense, self.bias)
        return y.to(dtype).reshape(*shape[:-1], w.out_features)


class GroupedEmbedding(nn.Module):
    """Token embeddings kept as a GroupedWeight [vocab, hidden]: only the looked-up rows are dequantized."""

    def __init__(self, weight: GroupedWeight, dtype: torch.dtype):
        super().__init__()
        if weight.perm is not None:
            raise ValueError("an embedding cannot have an act-order permutation")
        self.weight_q = weight
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.weight_q.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_q
        rows = GroupedWeight(w.q.index_select(0, ids.reshape(-1)), w.scales.index_select(0, ids.reshape(-1)),
                             None if w.offsets is None else w.offsets.index_select(0, ids.reshape(-1)),
                             w.bits, w.group, w.in_features)
        return rows.dequantize().to(self.dtype).reshape(*ids.shape, w.in_features)


def from_unsigned(ints: torch.Tensor, zeros: torch.Tensor | float, scales: torch.Tensor, bits: int, group: int,
                  perm: torch.Tensor | None = None) -> GroupedWeight:
    """W = (q − z) · s with q in 0 .. 2^bits − 1 (ints [N, K]), zero points z [N, G] (or one number) and
    scales s [N, G]: the asymmetric form AWQ, GPTQ and compressed-tensors share. Stored as q·s + m with
    m = −z·s (4-bit), or as int8 q − 128 with m = (128 − z)·s (8-bit); both exact in float32 for fp16 s."""
    scales = scales.to(torch.float32)
    z = zeros.to(torch.float32) if isinstance(zeros, torch.Tensor) else torch.full_like(scales, float(zeros))
    n, k = ints.shape
    if bits == 4:
        return GroupedWeight(pack_nibbles(ints), scales, -z * scales, 4, group, k, perm)
    return GroupedWeight((ints.to(torch.int32) - 128).to(torch.int8), scales, (128.0 - z) * scales, 8, group, k, perm)
