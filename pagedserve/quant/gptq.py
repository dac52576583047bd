"""GPTQ checkpoints in the AutoGPTQ / GPTQModel layout (`quant_method: gptq`), 4 or 8 bit.

Per linear with in_features K, out_features N, group size g (config `group_size`; −1: one group):
  * `qweight` int32 [K·bits/32, N]: 32/bits values per int32 along the input dim, lowest bits first;
  * `qzeros`  int32 [G, N·bits/32]: zero points packed the same way along the output dim;
  * `scales`  float16 [G, N];
  * `g_idx`   int32 [K]: the group of each input column (act-order, `desc_act: true`, permutes it).
W[n, k] = (q[k, n] − z[g_idx[k], n]) · s[g_idx[k], n], where the stored zero point is z − 1 in
AutoGPTQ's original format (`checkpoint_format: gptq`) and z itself in GPTQModel's `gptq_v2`.
With act-order the columns are sorted by group at load (grouped.py's `perm`: the layer reads
x[:, perm]), so each group is contiguous; every group must then hold `group_size` columns.
"""
from __future__ import annotations

import torch

from pagedserve.errors import ConfigError
from pagedserve.quant.builder import Format, TensorError, need
from pagedserve.quant.grouped import from_unsigned
from pagedserve.quant.packing import unpack_int32


def check_config(qcfg: dict) -> tuple[int, int, bool]:
    bits = qcfg.get("bits")
    if bits not in (4, 8):
        raise ConfigError(f"GPTQ with {bits}-bit weights is not supported (supported: 4 and 8 bit)")
    group = qcfg.get("group_size", 128)
    if not isinstance(group, int) or (group != -1 and (group <= 0 or (bits == 4 and group % 32))):
        raise ConfigError(f"GPTQ group_size {group!r} is not supported (supported: -1 or a positive multiple of 32)")
    fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    return bits, group, fmt == "gptq"


class GPTQFormat(Format):
    name = "gptq"

    def __init__(self, get, qcfg: dict):
        super().__init__(get)
        self.bits, self.group_cfg, self.zero_minus_one = check_config(qcfg)
        self.desc_act = bool(qcfg.get("desc_act", False))

    def load(self, prefix: str):
        bits, per = self.bits, 32 // self.bits
        qweight = need(self.get, prefix + ".qweight")
        qzeros = need(self.get, prefix + ".qzeros")
        scales = need(self.get, prefix + ".scales")
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise TensorError(prefix + ".qweight", f"expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
        k, n = qweight.shape[0] * per, qweight.shape[1]
        group = k if self.group_cfg == -1 else self.group_cfg
        groups = -(-k // group)
        if tuple(scales.shape) != (groups, n):
            raise TensorError(prefix + ".scales", f"shape {tuple(scales.shape)}, expected ({groups}, {n}) for "
                                                  f"{k} inputs, {n} outputs and group_size {self.group_cfg}")
        if tuple(qzeros.shape) != (groups, n // per):
            raise TensorError(prefix + ".qzeros", f"shape {tuple(qzeros.shape)}, expected ({groups}, {n // per})")
        ints = unpack_int32(qweight, bits, 0).t().contiguous()  # [N, K]
        zeros = unpack_int32(qzeros, bits, 1).t().to(torch.float32)  # [N, G]
        if self.zero_minus_one:
            zeros = zeros + 1
        perm = self._permutation(prefix, k, group, groups)
        if perm is not None:
            ints = ints.index_select(1, perm)
        if bits == 4 and k % 32:
            raise TensorError(prefix + ".qweight", f"{k} input features are not a multiple of 32")
        return from_unsigned(ints, zeros, scales.t(), bits, group, perm)

    def _permutation(self, prefix: str, k: int, group: int, groups: int) -> torch.Tensor | None:
        """None when g_idx is absent or the identity grouping; else the column order that makes groups contiguous."""
        try:
            g_idx = self.get(prefix + ".g_idx")
        except (ConfigError, KeyError):
            if self.desc_act:
                raise TensorError(prefix + ".g_idx", "missing, but desc_act is true") from None
            return None
        g_idx = g_idx.to(torch.int64).reshape(-1)
        if g_idx.numel() != k:
            raise TensorError(prefix + ".g_idx", f"has {g_idx.numel()} entries, expected one per input feature ({k})")
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise TensorError(prefix + ".g_idx", f"holds groups outside 0..{groups - 1}")
        natural = torch.arange(k) // group
        if torch.equal(g_idx, natural):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], natural):
            raise TensorError(prefix + ".g_idx", f"does not give every group {group} columns (group_size)")
        return perm
