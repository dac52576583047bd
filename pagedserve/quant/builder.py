"""Builds the model's linears from a quantized checkpoint, whatever its format.

A format (awq.py, gptq.py, gguf.py, ...) answers three questions: is the linear under this
checkpoint prefix quantized, what is its weight (`load`, in grouped.py's layout or fp8.py's), and
which module computes with it (`make_linear`). The builder does the rest for every format: it fuses
q/k/v and gate/up along the output dimension (or keeps them side by side when their layouts differ,
e.g. different act-order permutations), attaches the biases, and, for `--quantization none`,
writes the dequantized weight into the dense layer instead.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.errors import ConfigError


class TensorError(ConfigError):
    """A checkpoint tensor that is missing or inconsistent; the message names it."""

    def __init__(self, tensor: str, problem: str):
        super().__init__(f"quantized checkpoint tensor {tensor!r}: {problem}")
        self.tensor = tensor


def need(get, name: str) -> torch.Tensor:
    """get(name), with a missing tensor reported as a TensorError naming it."""
    try:
        return get(name)
    except (ConfigError, KeyError) as e:
        raise TensorError(name, "missing from the checkpoint") from e


class Format:
    """What one quantization format knows; subclasses override `load` (and the others where needed)."""

    name = "?"

    def __init__(self, get):
        self.get = get

    def is_quantized(self, prefix: str) -> bool:
        """Whether the linear at `prefix` (e.g. model.layers.0.self_attn.q_proj) is stored quantized."""
        return not prefix.startswith("lm_head") and not prefix.startswith("model.embed_tokens")

    def load(self, prefix: str):
        raise NotImplementedError

    def make_linear(self, weight, bias: torch.Tensor | None) -> nn.Module:
        from pagedserve.quant.grouped import GroupedLinear

        return GroupedLinear(weight, bias, self.name)

    def embedding(self, name: str, dtype: torch.dtype) -> nn.Module | None:
        """A module for a quantized token embedding, or None when it is stored dense."""
        return None


class ConcatLinear(nn.Module):
    """Fused projections whose parts could not share one quantized weight: outputs side by side."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class LinearBuilder:
    """Handed to LlamaForCausalLM.load_hf_state_dict: `linear` returns the module for a fused set of
    checkpoint prefixes, or None to let the model copy a dense weight as usual."""

    def __init__(self, fmt: Format, get, dense: bool = False):
        self.fmt, self.get, self.dense = fmt, get, dense

    def _bias(self, layer: nn.Linear, prefixes: list[str]) -> torch.Tensor | None:
        if layer.bias is None:
            return None
        return torch.cat([need(self.get, p + ".bias").to(torch.float32) for p in prefixes])

    def linear(self, layer: nn.Linear, prefixes: list[str]) -> nn.Module | None:
        quantized = [self.fmt.is_quantized(p) for p in prefixes]
        if not any(quantized):
            return None
        if not all(quantized):
            raise TensorError(prefixes[quantized.index(False)] + ".weight",
                              f"stored dense while {prefixes[quantized.index(True)]} is quantized; they are fused into one layer")
        parts = [self.fmt.load(p) for p in prefixes]
        for p, w in zip(prefixes, parts):
            if w.in_features != layer.in_features:
                raise TensorError(p + ".weight", f"has {w.in_features} input features, the model expects {layer.in_features}")
        if sum(w.out_features for w in parts) != layer.out_features:
            raise TensorError(prefixes[0] + ".weight", f"output features {[w.out_features for w in parts]} do not add up "
                                                       f"to the model's {layer.out_features}")
        bias = self._bias(layer, prefixes)
        if self.dense:
            with torch.no_grad():
                layer.weight.copy_(torch.cat([_dense(w) for w in parts]))
                if bias is not None:
                    layer.bias.copy_(bias)
            return layer
        try:
            return self.fmt.make_linear(type(parts[0]).stack(parts), bias)
        except ValueError:
            sizes = [w.out_features for w in parts]
            biases = bias.split(sizes) if bias is not None else [None] * len(parts)
            return ConcatLinear([self.fmt.make_linear(w, b) for w, b in zip(parts, biases)])

    def embedding(self, layer: nn.Embedding, name: str) -> nn.Module | None:
        if self.dense:
            return None
        return self.fmt.embedding(name, layer.weight.dtype)


def _dense(w) -> torch.Tensor:
    """The dequantized weight in the layer's own column order (an act-order permutation undone)."""
    d = w.dequantize()
    perm = getattr(w, "perm", None)
    if perm is not None:
        d = torch.empty_like(d).index_copy_(1, perm, d)
    return d


def weight_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(all weight bytes, the quantized modules' bytes, how many quantized modules) of a built model;
    a quantized weight shared by two modules (a tied embedding and LM head) counts once."""
    dense = quantized_bytes = layers = 0
    seen: set[int] = set()
    for mod in model.modules():
        w = getattr(mod, "weight_q", None)
        if w is not None:
            layers += 1
            if id(w) not in seen:
                seen.add(id(w))
                quantized_bytes += mod.nbytes
            continue
        for t in mod.parameters(recurse=False):
            if id(t) not in seen:
                seen.add(id(t))
                dense += t.numel() * t.element_size()
    return dense + quantized_bytes, quantized_bytes, layers
