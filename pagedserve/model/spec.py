"""ModelSpec: the architecture facts the engine needs, read from a Hugging Face config.

One flat object instead of transformers' config, so the model code does not depend on which
transformers version wrote config.json (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2 always; Llama's attention_bias flag)
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_complete_config_dict(cls, d: dict) -> "ModelSpec | None":
        """The spec straight from config.json's dict, without importing transformers' config classes
        (a second or two of start-up), when the file states every field whose default differs
        between model types; None otherwise, and the caller asks transformers."""
        required = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                    "tie_word_embeddings"]
        if d.get("model_type") == "mistral":
            required.append("sliding_window")
        if any(k not in d for k in required) or not ("rope_parameters" in d or "rope_theta" in d):
            return None
        if d["model_type"] not in ("llama", "qwen2", "mistral"):
            return None
        from types import SimpleNamespace

        return cls.from_hf_config(SimpleNamespace(**d))

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
            arch = by_type.get(getattr(cfg, "model_type", None))
        if arch is None:
            raise ConfigError(
                f"model architecture {archs or getattr(cfg, 'model_type', '?')} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        legacy = getattr(cfg, "rope_scaling", None)
        if legacy and not rope:
            rope = dict(legacy)
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        sliding = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "model_type", "") == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            sliding = None
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={act!r} is not supported (Llama-family models use silu)")
        # transformers 5 calls `torch_dtype` deprecated (a property that warns when read): read it
        # only where it is a plain attribute (transformers 4.x)
        dtype = getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype")
        return cls(
            architecture=arch,
            model_type=getattr(cfg, "model_type", "llama"),
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            hidden_act=act,
            sliding_window=sliding,
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
