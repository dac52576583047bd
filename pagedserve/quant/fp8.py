"""FP8 (e4m3) weights: vLLM's `fp8` checkpoints, compressed-tensors' FP8 scheme, and dynamic FP8 from
a full-precision checkpoint (`--quantization fp8` on a model without quantization_config).

Layout: `weight` float8_e4m3fn [N, K] and `weight_scale` float32, one per tensor (a scalar) or one
per output channel ([N] or [N, 1]); W = weight · scale. Dynamic FP8 uses one scale per tensor,
max|W| / 448 (e4m3's largest finite value), as vLLM does. Block-wise scales (`weight_block_size`)
are refused at start.

CPUs have no FP8 arithmetic: the linear dequantizes its weight in blocks of output rows into
float32 and multiplies each block, so no float32 copy of the whole weight is ever kept. A static
or dynamic FP8 *activation* scheme in the checkpoint is computed with float activations (the
weight-only form of the scheme), as on GPUs without FP8 tensor cores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.errors import ConfigError
from pagedserve.quant.builder import Format, TensorError, need

E4M3_MAX = 448.0
ROW_BLOCK = 256  # output rows dequantized at a time


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.weight[rows].to(torch.float32) * self.scale[rows, None]

    @staticmethod
    def stack(parts: "list[Fp8Weight]") -> "Fp8Weight":
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def quantize_per_tensor(w: torch.Tensor) -> Fp8Weight:
    w = w.to(torch.float32)
    amax = w.abs().max()
    scale = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale.reshape(1).expand(w.shape[0]).contiguous())


class Fp8Linear(nn.Module):
    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, fmt: str = "fp8"):
        super().__init__()
        self.weight_q = weight
        self.bias = None if bias is None else bias.to(torch.float32)
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.format = fmt

    @property
    def nbytes(self) -> int:
        return self.weight_q.nbytes + (self.bias.numel() * 4 if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format} e4m3"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).to(torch.float32)
        n = self.out_features
        y = torch.empty((x2.shape[0], n), dtype=torch.float32, device=x.device)
        for r0 in range(0, n, ROW_BLOCK):
            rows = slice(r0, min(n, r0 + ROW_BLOCK))
            y[:, rows] = F.linear(x2, self.weight_q.dequantize(rows).to(x.device),
                                  None if self.bias is None else self.bias[rows].to(x.device))
        return y.to(dtype).reshape(*shape[:-1], n)


def load_fp8(get, prefix: str, scale_name: str = "weight_scale") -> Fp8Weight:
    w = need(get, prefix + ".weight")
    if w.dtype != torch.float8_e4m3fn:
        raise TensorError(prefix + ".weight", f"is {w.dtype}, expected float8_e4m3fn")
    s = need(get, prefix + "." + scale_name).to(torch.float32)
    n = w.shape[0]
    if s.numel() == 1:
        s = s.reshape(1).expand(n).contiguous()
    elif s.numel() == n and s.dim() <= 2 and s.shape[0] == n:
        s = s.reshape(n).contiguous()
    else:
        raise TensorError(prefix + "." + scale_name, f"shape {tuple(s.shape)}: expected one scale per tensor or per "
                                                     f"output channel ({n})")
    return Fp8Weight(w, s)


class Fp8Format(Format):
    """vLLM's serialized fp8 checkpoints (quant_method fp8)."""

    name = "fp8"

    def __init__(self, get, qcfg: dict):
        super().__init__(get)
        check_config(qcfg)
        self.skip = tuple(qcfg.get("ignored_layers") or ())

    def is_quantized(self, prefix: str) -> bool:
        return super().is_quantized(prefix) and not any(s in prefix for s in self.skip)

    def load(self, prefix: str) -> Fp8Weight:
        return load_fp8(self.get, prefix)

    def make_linear(self, weight, bias):
        return Fp8Linear(weight, bias, self.name)


class DynamicFp8Format(Fp8Format):
    """--quantization fp8 on a full-precision checkpoint: per-tensor e4m3 at load."""

    def __init__(self, get):
        Format.__init__(self, get)
        self.skip = ()

    def load(self, prefix: str) -> Fp8Weight:
        return quantize_per_tensor(need(self.get, prefix + ".weight"))


def check_config(qcfg: dict) -> None:
    if qcfg.get("weight_block_size"):
        raise ConfigError(f"fp8 with block-wise scales (weight_block_size {qcfg['weight_block_size']}) is not supported "
                          "(supported: per-tensor and per-channel scales)")
    fmt = str(qcfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ConfigError(f"fp8 format {fmt!r} is not supported (supported: e4m3)")
