"""Inputs of `pagedserve plan`: constants, the GPU table, the model's config.json and what it implies
(shape, dtype, quantization, tensor-parallel sizes)."""
from __future__ import annotations

import json
from pathlib import Path


GIB = 1024**3
GB = 1e9
OVERHEAD_BYTES = 1 * GIB
INT4_GROUP_SIZE = 128
MAX_NUM_SEQS_CAP = 256
UTILIZATION_MAX = 0.95
TP_CANDIDATES = (1, 2, 4, 8)

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
QUANTIZATIONS = ("int8", "int4", "fp8")  # the size classes plan's arithmetic knows
# the engine's --quantization names (pagedserve.quant) → their size class; 4-or-8-bit formats read bits
QUANT_METHODS = ("awq", "gptq", "compressed-tensors", "w8a8")
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2")

JSON_KEYS = (
    "model", "settings", "gpu", "params", "weights", "kv_cache", "memory", "capacity",
    "verdict", "fixes", "recommended", "decode", "prefill", "warnings", "formulas",
)

FORMULAS = {
    "kv_bytes_per_token": "2 x num_layers x num_kv_heads x head_dim x kv_dtype_bytes (per GPU: kv heads per rank)",
    "kv_budget": "gpu_memory x gpu_memory_utilization - weights - activations - overhead",
    "activations": "max_num_batched_tokens x (2*hidden + qkv_width/tp + 3*intermediate/tp) x dtype_bytes"
                   " + max_num_seqs x vocab x 4",
    "overhead": "1 GiB fixed (CUDA context, cuBLAS/NCCL workspaces, CUDA graphs, fragmentation)",
    "num_blocks": "floor(kv_budget / (block_size x kv_bytes_per_token_per_gpu))",
    "decode_tokens_per_s_per_seq": "bandwidth / (weights_per_gpu + n x context_len x kv_bytes_per_token_per_gpu)",
    "prefill_tokens_per_s": "tp x peak_flops / (2 x params) (100 % MFU, attention FLOPs ignored)",
}


class PlanError(Exception):
    """A user error: printed as one line, exit code 2."""


def load_gpus() -> dict:
    path = Path(__file__).parent.parent / "data" / "gpus.json"
    with open(path) as f:
        return json.load(f)["gpus"]


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def gpu_variant_note(name: str, key: str, gpus: dict) -> str | None:
    """A warning when a short --gpu name stood for one of several variants (H100 = H100-80GB SXM)."""
    if _norm(name) == _norm(key):
        return None
    family = _norm(key.split("-")[0])
    others = [k for k in gpus if k != key and _norm(k.split("-")[0]) == family]
    spec = gpus[key]
    return (f"--gpu {name} taken as {key} ({spec['memory_gb_datasheet']} GB, {spec['bandwidth_gb_s']} GB/s)"
            + (f"; other variants: {', '.join(others)}" if others else ""))


def find_gpu(name: str, gpus: dict) -> tuple[str, dict]:
    want = _norm(name)
    for key, spec in gpus.items():
        if want == _norm(key) or want in (_norm(a) for a in spec.get("aliases", ())):
            return key, spec
    raise PlanError(f"unknown --gpu {name!r}; known GPUs: {', '.join(gpus)}")


def model_shape(cfg: dict) -> dict:
    """The architecture numbers plan needs, from a Llama-family HF config."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "torch_dtype"}}
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(moe_key):
            raise PlanError(f"config has {moe_key}={cfg[moe_key]}: mixture-of-experts models are not modelled by plan")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(cfg.get(k), int) or cfg.get(k) <= 0]
    if missing:
        raise PlanError(f"config.json lacks {', '.join(missing)} (plan needs a Llama-family config)")
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if not cfg.get("head_dim") and hidden % heads:
        raise PlanError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim given")
    if heads % kv_heads:
        raise PlanError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    model_type = str(cfg.get("model_type", "llama"))
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "config_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
        "quantization_config": cfg.get("quantization_config"),
    }


def resolve_dtype(requested: str, config_dtype) -> tuple[str, str | None]:
    """Model dtype like vLLM's --dtype auto: the checkpoint's dtype, float32 checkpoints run in float16."""
    if requested != "auto":
        return requested, None
    cd = _DTYPE_ALIASES.get(str(config_dtype), str(config_dtype)) if config_dtype else None
    if cd in ("float16", "bfloat16"):
        return cd, None
    if cd == "float32":
        return "float16", "config torch_dtype is float32; --dtype auto serves it in float16 (pass --dtype float32 to keep it)"
    return "float16", f"config torch_dtype {config_dtype!r} not understood; assuming float16"


def _bits(method: str, qcfg) -> int | None:
    """The weight bits a quantization_config states (AutoAWQ/GPTQ `bits`/`w_bit`, compressed-tensors' groups)."""
    if not isinstance(qcfg, dict):
        return None
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    if bits is None and method == "compressed-tensors":
        groups = [g for g in (qcfg.get("config_groups") or {}).values() if isinstance(g, dict)]
        found = {(g.get("weights") or {}).get("num_bits") for g in groups}
        bits = found.pop() if len(found) == 1 else None
    return bits if isinstance(bits, int) else None


def resolve_quantization(requested: str | None, qcfg) -> tuple[str | None, int, str | None]:
    """(quantization size class, int4 group size, note). An explicit flag wins; else read the config's
    quantization_config. A method name (awq, gptq, ...) counts as its bits' class."""
    group = INT4_GROUP_SIZE
    if isinstance(qcfg, dict) and isinstance(qcfg.get("group_size"), int) and qcfg["group_size"] > 0:
        group = qcfg["group_size"]
    if requested in QUANT_METHODS:
        bits = 8 if requested == "w8a8" else (_bits(requested, qcfg) or 4)
        if bits not in (4, 8):
            raise PlanError(f"--quantization {requested} with {bits}-bit weights: plan models 4 and 8 bits")
        q = "int4" if bits == 4 else "int8"
        return q, group, f"--quantization {requested}: {bits}-bit weights, counted as {q}"
    if requested is not None:
        return (None if requested == "none" else requested), group, None
    if not qcfg:
        return None, group, None
    method = str(qcfg.get("quant_method", "")).lower() if isinstance(qcfg, dict) else ""
    bits = _bits(method, qcfg)
    if method == "fp8":
        return "fp8", group, "quantization fp8 read from config.json quantization_config"
    if method in ("awq", "gptq", "marlin", "compressed-tensors", "gguf") and bits in (4, 8):
        q = "int4" if bits == 4 else "int8"
        return q, group, f"quantization {q} read from config.json quantization_config ({method}, {bits}-bit)"
    raise PlanError(f"config.json has quantization_config quant_method={method or '?'} bits={bits}, which plan does not"
                    " model; pass --quantization int8|int4|fp8|none")
