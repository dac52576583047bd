"""AWQ checkpoints in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`).

Per linear with in_features K, out_features N, group size g (config `group_size`), 4 bits:
  * `qweight` int32 [K, N/8]: 8 four-bit values per int32 along the output dim, nibble i holding
    column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] of pack c (AutoAWQ's GEMM order);
  * `qzeros`  int32 [K/g, N/8]: the zero points, packed the same way;
  * `scales`  float16 [K/g, N].
W[n, k] = (q[k, n] − z[k/g, n]) · s[k/g, n]. Loaded into grouped.py's layout (transposed to [N, K]).
"""
from __future__ import annotations

import torch

from pagedserve.errors import ConfigError
from pagedserve.quant.builder import Format, TensorError, need
from pagedserve.quant.grouped import from_unsigned
from pagedserve.quant.packing import unpack_awq


def check_config(qcfg: dict) -> tuple[int, int]:
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    group = qcfg.get("group_size", qcfg.get("q_group_size"))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4:
        raise ConfigError(f"AWQ with {bits}-bit weights is not supported (supported: 4-bit)")
    if version != "gemm":
        raise ConfigError(f"AWQ version {version!r} is not supported (supported: gemm, AutoAWQ's default layout)")
    if not qcfg.get("zero_point", True):
        raise ConfigError("AWQ without zero points (zero_point: false) is not supported (supported: zero_point true)")
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ConfigError(f"AWQ group_size {group!r} is not supported (supported: a positive multiple of 32)")
    return bits, group


class AWQFormat(Format):
    name = "awq"

    def __init__(self, get, qcfg: dict):
        super().__init__(get)
        self.bits, self.group = check_config(qcfg)
        self.skip = tuple(qcfg.get("modules_to_not_convert") or ())

    def is_quantized(self, prefix: str) -> bool:
        return super().is_quantized(prefix) and not any(s in prefix for s in self.skip)

    def load(self, prefix: str):
        qweight = need(self.get, prefix + ".qweight")
        qzeros = need(self.get, prefix + ".qzeros")
        scales = need(self.get, prefix + ".scales")
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise TensorError(prefix + ".qweight", f"expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = -(-k // self.group)
        if k % self.group:
            raise TensorError(prefix + ".qweight", f"{k} input features are not a multiple of group_size {self.group}")
        if tuple(scales.shape) != (groups, n):
            raise TensorError(prefix + ".scales", f"shape {tuple(scales.shape)}, expected ({groups}, {n}) for "
                                                  f"{k} inputs, {n} outputs and group_size {self.group}")
        if tuple(qzeros.shape) != (groups, n // 8):
            raise TensorError(prefix + ".qzeros", f"shape {tuple(qzeros.shape)}, expected ({groups}, {n // 8})")
        ints = unpack_awq(qweight).t().contiguous()  # [N, K]
        zeros = unpack_awq(qzeros).t()
        return from_unsigned(ints, zeros, scales.t(), 4, self.group)
