"""Llama-family decoder (Llama 2/3, Qwen2, Mistral), driven by a ModelSpec.

The model sees a flat batch of tokens with their positions and attention metadata; it knows
nothing of requests. q/k/v and gate/up projections are fused into single GEMMs at load time.
Numerics follow transformers: RMSNorm in float32, rotary tables in float32, logits in float32.
When the CPU model runner turns on `fused_cpu_ops` (float32 or bfloat16 on the CPU, native kernels
built), the element-wise steps run as fused native ops (kernels/cpu/fused_ops.py): the residual
stream is then carried as (residual, delta) so each residual add happens inside the next RMSNorm's
pass, and, with a backend whose `cache_written_by_rope` is set, rotary embedding writes K/V
straight into the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu import fused_ops as cpu_fused
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.model.rope import RotaryEmbedding
from pagedserve.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward(x), or with `residual`: residual += x in place, then forward(residual)."""
        return cpu_fused.rms_norm(x, self.weight, self.eps, residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias,
                                  dtype=dtype)
        # Llama's attention_bias also covers o_proj; Qwen2 has q/k/v biases only.
        self.o_bias = spec.attention_bias and spec.model_type != "qwen2"
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=self.o_bias, dtype=dtype)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, positions, rope, meta, kv_cache, backend):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def forward_fused(self, x, positions, rope, meta, kv_cache, backend):
        """forward() with rotary embedding and the cache write in one native pass; only when the
        native paged kernel takes the whole batch (see LlamaForCausalLM.forward)."""
        q = cpu_fused.rope_qkv(self.qkv_proj(x), positions, rope.cos, rope.sin, meta.slot_mapping, kv_cache[0],
                               kv_cache[1], self.num_heads, self.num_kv_heads, self.head_dim)
        o = backend.attend_cached(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self.inter = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias, dtype=dtype)
        # [gate | up]: the CPU packer may give it a GEMM that stores silu(gate) · up (cpu_linear.py)
        self.gate_up_proj.gate_up_halves = True
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x):
        if hasattr(self.gate_up_proj, "silu_mul"):  # a packed layer that stores silu(gate) · up from its tiles
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        return self.down_proj(cpu_fused.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, idx, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = MLP(spec, dtype)

    def forward(self, h, positions, rope, meta, kv_cache, backend):
        h = h + self.self_attn(self.input_layernorm(h), positions, rope, meta, kv_cache, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, residual, delta, positions, rope, meta, kv_cache, backend, fused_attention: bool):
        """The same layer on the fused CPU ops: residual += delta (the previous layer's output,
        None for the first), in place, and this layer's output delta is returned."""
        x = self.input_layernorm.fused(delta, residual) if delta is not None else self.input_layernorm.fused(residual)
        attn = self.self_attn.forward_fused if fused_attention else self.self_attn.forward
        a = attn(x, positions, rope, meta, kv_cache, backend)
        return self.mlp.forward_fused(self.post_attention_layernorm.fused(a, residual))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype | None = None):
        """Parameters are created in `dtype` on the current default device (see loader._build)."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        self.rope = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling)
        self.fused_cpu_ops = False  # set by the CPU model runner (runner/cpu_runner.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.fused_cpu_ops:
            fused_attention = getattr(backend, "cache_written_by_rope", False)
            delta = None
            for layer, cache in zip(self.layers, kv_caches):
                delta = layer.forward_fused(h, delta, positions, self.rope, meta, cache, backend, fused_attention)
            return self.norm.fused(delta, h) if delta is not None else self.norm.fused(h)
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, positions, self.rope, meta, cache, backend)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits in float32 as transformers gives them; upcast=False leaves the LM head's dtype."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    # ---- weights ----------------------------------------------------------------------------
    def load_hf_state_dict(self, tensors, linears=None) -> None:
        """tensors: name -> tensor (or a callable name -> tensor) in Hugging Face naming.
        linears: a quant.builder.LinearBuilder for a quantized checkpoint: it returns the module for
        each linear (and embedding) it stores quantized; the model never sees the format."""
        get = tensors if callable(tensors) else tensors.__getitem__
        spec = self.spec
        with torch.no_grad():
            emb = linears.embedding(self.embed_tokens, "model.embed_tokens.weight") if linears else None
            if emb is not None:
                self.embed_tokens = emb
            else:
                self.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
            self.norm.weight.copy_(get("model.norm.weight"))
            self._load_linear(self, "lm_head", ["model.embed_tokens" if spec.tie_word_embeddings else "lm_head"], get,
                              linears)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a, m = layer.self_attn, layer.mlp
                self._load_linear(a, "qkv_proj", [p + f"self_attn.{n}_proj" for n in "qkv"], get, linears)
                self._load_linear(a, "o_proj", [p + "self_attn.o_proj"], get, linears)
                self._load_linear(m, "gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], get, linears)
                self._load_linear(m, "down_proj", [p + "mlp.down_proj"], get, linears)
                layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))

    @staticmethod
    def _load_linear(owner: nn.Module, attr: str, prefixes: list[str], get, linears) -> None:
        """The linear `owner.attr` from the checkpoint linears at `prefixes`, stacked along the output
        (q/k/v, gate/up): quantized when `linears` builds it, else the dense weights copied in."""
        layer = getattr(owner, attr)
        built = linears.linear(layer, prefixes) if linears is not None else None
        if built is not None:
            setattr(owner, attr, built)
            return
        layer.weight.copy_(torch.cat([get(n + ".weight") for n in prefixes]))
        if layer.bias is not None:
            layer.bias.copy_(torch.cat([get(n + ".bias") for n in prefixes]))
