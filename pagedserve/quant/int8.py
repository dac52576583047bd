"""`--quantization int8` and `w8a8`: a full-precision checkpoint quantized at load, no file to prepare.

Each decoder linear's weight becomes int8 with one float32 scale per output channel,
s[n] = max_k |W[n, k]| / 127 and q = round(W / s) (symmetric, round half to even as torch rounds):
grouped.py's layout with one group spanning the whole row. The LM head and embeddings stay in the
model dtype (as vLLM keeps them).
  * int8 (weight-only): activations stay float; the kernel widens q to float32 (grouped.py).
  * w8a8: each activation row is also quantized to int8 per token at run time (scale max|x| / 127)
    and the products are summed exactly in int32 (csrc w8a8_linear). The error of the activation
    rounding adds to the weight's: ~0.4 % of a row's largest value per element.
"""
from __future__ import annotations

import torch


from pagedserve.quant.builder import Format, need
from pagedserve.quant.grouped import GroupedLinear, GroupedWeight


def quantize_per_channel(w: torch.Tensor) -> GroupedWeight:
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return GroupedWeight(q, scale, None, 8, w.shape[1], w.shape[1])


class Int8Format(Format):
    name = "int8"

    def load(self, prefix: str) -> GroupedWeight:
        return quantize_per_channel(need(self.get, prefix + ".weight"))


class W8A8Format(Int8Format):
    name = "w8a8"

    def make_linear(self, weight, bias):
        return W8A8Linear(weight, bias, self.name)


class W8A8Linear(GroupedLinear):
    """int8 weights (one scale per output channel) × activations quantized per token to int8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedserve.quant import cpu_kernels

        lib = cpu_kernels.load() if x.device.type == "cpu" else None
        w = self.weight_q
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
        if lib is None:
            y = w8a8_reference(x2, w, self.bias)
        else:
            y = torch.empty((x2.shape[0], w.out_features), dtype=torch.float32)
            lib.w8a8_linear(x2.data_ptr(), x2.stride(0), x2.shape[0], w.q.data_ptr(), w.out_features, w.in_features,
                            w.scales.data_ptr(), self.bias.data_ptr() if self.bias is not None else None, y.data_ptr(),
                            y.stride(0), torch.get_num_threads())
        return y.to(dtype).reshape(*shape[:-1], w.out_features)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of activations: (int8 values, float32 scale per row)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def w8a8_reference(x: torch.Tensor, w: GroupedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The same arithmetic with torch ops: int products summed exactly (float64 holds them), scaled."""
    xq, xs = quantize_rows(x)
    dots = xq.to(torch.float64) @ w.q.to(torch.float64).t()
    y = (dots * xs.to(torch.float64) * w.scales[:, 0].to(torch.float64)).to(torch.float32)
    return y + bias if bias is not None else y


