"""Unpacking of the int32-packed integer tensors that AWQ, GPTQ and compressed-tensors checkpoints store."""
from __future__ import annotations

import torch

# AutoAWQ's GEMM layout packs the 8 columns of each int32 in this order: nibble i holds column _AWQ_ORDER[i]
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sequential packing along `dim`: value j of each int32 sits at bits [j·bits, (j+1)·bits), the
    lowest first (GPTQ, compressed-tensors). Returns int32 values 0 .. 2^bits − 1."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(-1)
    vals = (p >> shifts) & ((1 << bits) - 1)  # [..., per] along the last dim
    vals = vals.movedim(dim if dim >= 0 else dim - 1, -2) if dim not in (-1, packed.dim() - 1) else vals
    out = vals.reshape(*vals.shape[:-2], vals.shape[-2] * per)
    return out.movedim(-1, dim) if dim not in (-1, packed.dim() - 1) else out


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM: 4-bit values packed along the last (output) dim in _AWQ_ORDER."""
    seq = unpack_int32(packed, 4, -1)
    n = seq.shape[-1]
    order = torch.tensor(_AWQ_ORDER)
    cols = (torch.arange(n) // 8 * 8).reshape(-1, 8) + order  # where nibble i of pack c lands
    out = torch.empty_like(seq)
    out[..., cols.reshape(-1)] = seq
    return out
