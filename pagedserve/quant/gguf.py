"""GGUF tensors kept quantized: llama.cpp's block formats in grouped.py's layout.

Block formats (ggml's definitions; d, dmin, m are float16 in the file, exact in float32):
  * Q4_0 (18 bytes per 32 weights): d, 16 bytes of nibbles;  w = d · (q − 8).
  * Q4_1 (20 bytes): d, m, 16 bytes of nibbles;  w = d · q + m.
    Both nibble orders are grouped.py's own, so the 16 bytes are copied as stored: 4-bit, group 32,
    scale d, offset −8d (Q4_0) or m (Q4_1).
  * Q8_0 (34 bytes): d, 32 int8;  w = d · q.  8-bit, group 32, no offset.
  * Q4_K (144 bytes per 256): d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    128 bytes of nibbles;  w = d·sc_j · q − dmin·m_j.  4-bit, group 32.
  * Q5_K (176 bytes per 256): as Q4_K with a fifth bit per weight (q 0..31).  8-bit, group 32.
  * Q6_K (210 bytes per 256): 6-bit q − 32 in 16 sub-blocks of 16 with int8 scales, one d;
    w = d·sc_j · (q − 32).  8-bit, group 16.
K-quant integers are recovered from gguf-py's own dequantization (w − m) / s, rounded, and checked
to be whole numbers in range, so the bit-unpacking stays ggml's. Q5_K and Q6_K take 8 bits per
weight here (more than the 5.5 / 6.6 they take in the file).
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.quant.builder import Format, TensorError
from pagedserve.quant.grouped import GroupedEmbedding, GroupedWeight, pack_nibbles

KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _f16(raw: np.ndarray, offset: int) -> np.ndarray:
    """float16 fields at byte `offset` of each block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit (scale, min) pairs of each 256-block (ggml's get_scale_min_k4)."""
    s = raw[..., 4:16].astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _ints_from_dequantized(name: str, raw: np.ndarray, qtype, scale: np.ndarray, offset: np.ndarray | None,
                           group: int, lo: int, hi: int) -> np.ndarray:
    from gguf.quants import dequantize

    rows = raw.shape[0]
    w = dequantize(raw, qtype).reshape(rows, -1, group).astype(np.float64)
    num = w - (offset[..., None] if offset is not None else 0.0)
    safe = np.where(scale == 0, 1.0, scale)[..., None]
    q = np.rint(num / safe)
    q = np.where(scale[..., None] == 0, 0 if lo <= 0 <= hi else lo, q)
    if q.min() < lo or q.max() > hi or np.abs(q * scale[..., None] - num).max() > 1e-3 * (np.abs(w).max() + 1e-30):
        raise TensorError(name, f"{qtype.name} blocks do not decode to integers in [{lo}, {hi}]")
    return q.reshape(rows, -1)


def grouped_from_blocks(name: str, type_name: str, raw: np.ndarray) -> GroupedWeight:
    """raw: uint8 [rows, bytes per row] as the GGUF stores them (rows in the model's order)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_w, block_b = gguf.GGML_QUANT_SIZES[qtype]
    rows, nbytes = raw.shape
    if nbytes % block_b:
        raise TensorError(name, f"{nbytes} bytes per row is not a whole number of {type_name} blocks")
    k = nbytes // block_b * block_w
    blocks = raw.reshape(rows, -1, block_b)
    t = torch.from_numpy
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(blocks, 0)
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        offset = _f16(blocks, 2) if type_name == "Q4_1" else -8.0 * d
        return GroupedWeight(t(np.ascontiguousarray(qs).reshape(rows, k // 2)), t(d), t(offset), 4, 32, k)
    if type_name == "Q8_0":
        d = _f16(blocks, 0)
        qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, k)
        return GroupedWeight(t(qs), t(d), None, 8, 32, k)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks)
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = (-(dmin[..., None] * mn)).reshape(rows, -1)
        hi = 15 if type_name == "Q4_K" else 31
        q = _ints_from_dequantized(name, raw, qtype, scale.astype(np.float64), offset.astype(np.float64), 32, 0, hi)
        if type_name == "Q4_K":
            return GroupedWeight(pack_nibbles(t(q.astype(np.uint8))), t(scale), t(offset), 4, 32, k)
        return GroupedWeight(t(q.astype(np.int8)), t(scale), t(offset), 8, 32, k)
    if type_name == "Q6_K":
        d = _f16(blocks, 208)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        scale = (d[..., None] * sc).reshape(rows, -1)
        q = _ints_from_dequantized(name, raw, qtype, scale.astype(np.float64), None, 16, -32, 31)
        return GroupedWeight(t(q.astype(np.int8)), t(scale), None, 8, 16, k)
    raise TensorError(name, f"GGUF type {type_name} is not kept quantized (kept: {', '.join(KEPT_TYPES)})")


class GGUFFormat(Format):
    """The tensors a GGUF file stores in a block format; the rest were dequantized by the loader."""

    name = "gguf"

    def __init__(self, get, quantized: dict):
        super().__init__(get)
        self.quantized = quantized  # HF name -> (type name, uint8 [rows, bytes])
        self._cache: dict[str, GroupedWeight] = {}

    def is_quantized(self, prefix: str) -> bool:
        return prefix + ".weight" in self.quantized

    def load(self, prefix: str) -> GroupedWeight:
        name = prefix + ".weight"
        if name not in self._cache:  # a tied embedding and LM head share one weight
            type_name, raw = self.quantized[name]
            self._cache[name] = grouped_from_blocks(name, type_name, raw.numpy())
        return self._cache[name]

    def make_linear(self, weight, bias):
        from pagedserve.quant.grouped import GroupedLinear

        return GroupedLinear(weight, bias, f"gguf {weight.bits}-bit")

    def embedding(self, name: str, dtype: torch.dtype):
        if name not in self.quantized:
            return None
        return GroupedEmbedding(self.load(name[: -len(".weight")]), dtype)
