"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: compressed-tensors`).

config.json names one scheme per group of layers (`config_groups`: `weights` and
`input_activations` of each, the `targets` they apply to) and the layers left dense (`ignore`).
Schemes loaded here (one config group targeting the Linear layers):
  * W4A16 / W8A16, `format: pack-quantized`, symmetric int weights: `weight_packed` int32
    [N, K·bits/32] holding q + 2^(bits−1) packed along the input dim, lowest bits first;
    `weight_scale` [N, G] (strategy group, G = K / group_size) or [N, 1] (strategy channel);
    `weight_shape` [2]. W = (packed − 2^(bits−1)) · scale.
  * W8A8-int8, `format: int-quantized`: `weight` int8 [N, K], `weight_scale` [N, 1]; activations
    int8 dynamic per token: the w8a8 linear (int8.py). With no input_activations, int8 weight-only.
  * FP8, `format: float-quantized`: `weight` float8_e4m3fn, `weight_scale` per tensor or channel
    (fp8.py; activations computed in float on CPUs).
Anything else (asymmetric packed weights, act-order `weight_g_idx`, several config groups) is a
one-line error naming what is supported.
"""
from __future__ import annotations

import re

import torch

from pagedserve.errors import ConfigError
from pagedserve.quant.builder import Format, TensorError, need
from pagedserve.quant.grouped import GroupedWeight, from_unsigned
from pagedserve.quant.packing import unpack_int32

SUPPORTED = "W4A16 / W8A16 (pack-quantized, symmetric), W8A8-int8 (int-quantized), FP8 (float-quantized)"


def parse(qcfg: dict) -> tuple[str, dict, dict | None]:
    """(format, weights args, input_activations args or None) of the one config group."""
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors with {len(groups)} config groups is not supported (supported: one "
                          f"group of Linear layers: {SUPPORTED})")
    group = next(iter(groups.values()))
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or qcfg.get("format")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    scheme = f"format {fmt}, {kind}{bits} weights, strategy {strategy}"
    if fmt == "pack-quantized":
        ok = kind == "int" and bits in (4, 8) and weights.get("symmetric", True) and strategy in ("group", "channel") \
            and not acts and not weights.get("actorder")
    elif fmt == "int-quantized":
        ok = kind == "int" and bits == 8 and strategy == "channel" and weights.get("symmetric", True) and (
            not acts or (acts.get("num_bits") == 8 and acts.get("type", "int") == "int" and acts.get("dynamic")
                         and acts.get("strategy") == "token" and acts.get("symmetric", True)))
    elif fmt == "float-quantized":
        ok = kind == "float" and bits == 8 and strategy in ("tensor", "channel")
    else:
        ok = False
    if not ok:
        raise ConfigError(f"compressed-tensors scheme ({scheme}{', activations ' + str(acts) if acts else ''}) is not "
                          f"supported (supported: {SUPPORTED})")
    return fmt, weights, acts


class CompressedTensorsFormat(Format):
    name = "compressed-tensors"

    def __init__(self, get, qcfg: dict):
        super().__init__(get)
        self.fmt, self.weights, self.acts = parse(qcfg)
        self.ignore = list(qcfg.get("ignore") or [])

    def is_quantized(self, prefix: str) -> bool:
        if not super().is_quantized(prefix):
            return False
        for pat in self.ignore:
            if (pat.startswith("re:") and re.match(pat[3:], prefix)) or pat == prefix:
                return False
        return True

    def load(self, prefix: str):
        if self.fmt == "float-quantized":
            from pagedserve.quant.fp8 import load_fp8

            return load_fp8(self.get, prefix)
        scale = need(self.get, prefix + ".weight_scale").to(torch.float32)
        if self.fmt == "int-quantized":
            w = need(self.get, prefix + ".weight")
            if w.dtype != torch.int8 or w.dim() != 2:
                raise TensorError(prefix + ".weight", f"expected 2-D int8, got {w.dtype} {tuple(w.shape)}")
            if tuple(scale.shape) not in ((w.shape[0], 1), (w.shape[0],)):
                raise TensorError(prefix + ".weight_scale", f"shape {tuple(scale.shape)}, expected ({w.shape[0]}, 1)")
            return GroupedWeight(w, scale.reshape(-1, 1), None, 8, w.shape[1], w.shape[1])
        bits = self.weights["num_bits"]
        packed = need(self.get, prefix + ".weight_packed")
        shape = [int(v) for v in need(self.get, prefix + ".weight_shape").reshape(-1).tolist()]
        n, k = shape
        if tuple(packed.shape) != (n, k * bits // 32):
            raise TensorError(prefix + ".weight_packed", f"shape {tuple(packed.shape)}, expected ({n}, {k * bits // 32}) "
                                                         f"for weight_shape {shape} at {bits} bits")
        group = k if self.weights.get("strategy") == "channel" else int(self.weights.get("group_size") or 0)
        if group <= 0 or (bits == 4 and group % 32):
            raise TensorError(prefix + ".weight_scale", f"group_size {group} is not supported (a multiple of 32)")
        groups = -(-k // group)
        if tuple(scale.shape) != (n, groups):
            raise TensorError(prefix + ".weight_scale", f"shape {tuple(scale.shape)}, expected ({n}, {groups}) for "
                                                        f"group_size {group}")
        ints = unpack_int32(packed, bits, 1)
        return from_unsigned(ints, float(2 ** (bits - 1)), scale, bits, group)

    def make_linear(self, weight, bias):
        if self.fmt == "float-quantized":
            from pagedserve.quant.fp8 import Fp8Linear

            return Fp8Linear(weight, bias, self.name)
        if self.fmt == "int-quantized" and self.acts:
            from pagedserve.quant.int8 import W8A8Linear

            return W8A8Linear(weight, bias, self.name)
        return super().make_linear(weight, bias)
