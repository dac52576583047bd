"""`pagedserve plan`: will this model fit on this GPU, how many sequences at once, and how fast can decode go?

Pure arithmetic on the Hugging Face config.json of a Llama-family model (llama, mistral, qwen2, ...);
no torch, no weights read. Every number is an estimate with a documented formula:

* Parameters: embeddings V*H; per layer q (H x heads*hd), k and v (H x kv_heads*hd each), o (heads*hd x H),
  gate/up (H x I each), down (I x H), two RMSNorm weights (H each); q/k/v biases when model_type is qwen2;
  final norm H; lm_head V*H unless tie_word_embeddings. hd = config head_dim, else H / heads.
* Weight bytes: model dtype for everything, except with --quantization the decoder linear layers
  (q/k/v/o/gate/up/down) take 1 byte per weight + one fp32 scale per output channel (int8, fp8), or
  0.5 byte per weight + one fp16 scale per group of 128 input weights per output channel (int4).
  Embeddings, lm_head, norms and biases stay in the model dtype (as GPTQ/AWQ/fp8 checkpoints keep them).
* Tensor parallelism (vLLM's rules): num_attention_heads % tp == 0 and intermediate_size % tp == 0;
  kv heads are split when num_kv_heads % tp == 0, replicated (one kv head per rank) when tp % num_kv_heads
  == 0, refused otherwise. Linear layers and the (vocab-parallel) embedding/lm_head are split across
  ranks; norms are replicated. Memory figures are per GPU.
* KV cache bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes of the KV dtype
  (per GPU: kv heads per rank instead of kv_heads).
* Memory budget per GPU: KV budget = GPU memory x utilization - weights - activations - overhead, where
  activations = max_num_batched_tokens x (2*H + qkv_width/tp + 3*I/tp) x activation bytes
               + max_num_seqs x vocab x 4 (fp32 logits of the sampled rows)
  and overhead = 1 GiB fixed (CUDA context, cuBLAS/NCCL workspaces, CUDA graphs, fragmentation).
* Decode ceiling (memory-bandwidth bound): every decode step reads all of a GPU's weights once plus the
  KV of every running sequence, so per-sequence tokens/s <= bandwidth / (weights + n x context x KV/token)
  and the aggregate is n times that. Real engines reach roughly 50-80 % of it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
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
QUANTIZATIONS = ("int8", "int4", "fp8")
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


# --------------------------------------------------------------------------- inputs

def load_gpus() -> dict:
    path = Path(__file__).parent / "data" / "gpus.json"
    with open(path) as f:
        return json.load(f)["gpus"]


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str, gpus: dict) -> tuple[str, dict]:
    want = _norm(name)
    for key, spec in gpus.items():
        if want == _norm(key) or want in (_norm(a) for a in spec.get("aliases", ())):
            return key, spec
    raise PlanError(f"unknown --gpu {name!r}; known GPUs: {', '.join(gpus)}")


def load_config(path: str) -> tuple[str, dict]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"--model {path!r}: no config.json there (give a model directory or a config.json path)")
    try:
        with open(p) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{p} is not a JSON object")
    return str(p), cfg


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


def resolve_quantization(requested: str | None, qcfg) -> tuple[str | None, int, str | None]:
    """(quantization, int4 group size, note). An explicit flag wins; else read the config's quantization_config."""
    group = INT4_GROUP_SIZE
    if isinstance(qcfg, dict) and isinstance(qcfg.get("group_size"), int) and qcfg["group_size"] > 0:
        group = qcfg["group_size"]
    if requested is not None:
        return (None if requested == "none" else requested), group, None
    if not qcfg:
        return None, group, None
    method = str(qcfg.get("quant_method", "")).lower() if isinstance(qcfg, dict) else ""
    bits = qcfg.get("bits") if isinstance(qcfg, dict) else None
    if method == "fp8":
        return "fp8", group, "quantization fp8 read from config.json quantization_config"
    if method in ("awq", "gptq", "marlin", "compressed-tensors") and bits in (4, 8):
        q = "int4" if bits == 4 else "int8"
        return q, group, f"quantization {q} read from config.json quantization_config ({method}, {bits}-bit)"
    raise PlanError(f"config.json has quantization_config quant_method={method or '?'} bits={bits}, which plan does not"
                    " model; pass --quantization int8|int4|fp8|none")


# --------------------------------------------------------------------------- arithmetic

def _tp_problem(shape: dict, tp: int) -> str | None:
    heads, kv, inter = shape["num_attention_heads"], shape["num_kv_heads"], shape["intermediate_size"]
    if tp < 1:
        return "--tensor-parallel-size must be >= 1"
    if heads % tp:
        return (f"--tensor-parallel-size {tp} does not divide num_attention_heads {heads} "
                "(each rank must hold whole attention heads)")
    if kv % tp and tp % kv:
        return (f"--tensor-parallel-size {tp} neither divides num_key_value_heads {kv} nor is a multiple of it "
                "(kv heads are split across ranks or replicated, never partly)")
    if inter % tp:
        return f"--tensor-parallel-size {tp} does not divide intermediate_size {inter}"
    return None


def valid_tp_sizes(shape: dict, upto: int = 8) -> list[int]:
    return [tp for tp in range(1, upto + 1) if _tp_problem(shape, tp) is None]


def check_tp(shape: dict, tp: int) -> int:
    """Refuse a TP size the engine cannot shard; returns the kv heads held per rank."""
    problem = _tp_problem(shape, tp)
    if problem:
        raise PlanError(f"{problem}; valid sizes up to 8: {', '.join(map(str, valid_tp_sizes(shape)))}")
    return max(1, shape["num_kv_heads"] // tp)


def weights(shape: dict, dtype_bytes: int, quant: str | None, tp: int, group: int = INT4_GROUP_SIZE) -> dict:
    """Parameter counts (whole model) and weight bytes (whole model and per GPU at this TP size)."""
    H, I, V, hd = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["head_dim"]
    nh, nkv, L = shape["num_attention_heads"], shape["num_kv_heads"], shape["num_layers"]

    def linear_bytes(in_f: int, out_f: int) -> float:
        n = in_f * out_f
        if quant in ("int8", "fp8"):
            return n * 1 + out_f * 4
        if quant == "int4":
            return n * 0.5 + out_f * math.ceil(in_f / group) * 2
        return n * dtype_bytes

    def layer(heads: int, kv_heads: int, inter: int) -> tuple[int, float]:
        q, kv = heads * hd, kv_heads * hd
        shapes = [(H, q), (H, kv), (H, kv), (q, H), (H, inter), (H, inter), (inter, H)]
        params = sum(a * b for a, b in shapes)
        byts = sum(linear_bytes(a, b) for a, b in shapes)
        extra = 2 * H + ((q + 2 * kv) if shape["qkv_bias"] else 0)  # norms (+ biases), model dtype
        return params + extra, byts + extra * dtype_bytes

    emb = V * H
    head = 0 if shape["tie_word_embeddings"] else V * H
    per_layer, _ = layer(nh, nkv, I)
    total = emb + head + L * per_layer + H

    kv_r = max(1, nkv // tp)
    v_r = math.ceil(V / tp)
    per_layer_gpu_params, per_layer_gpu_bytes = layer(nh // tp, kv_r, I // tp)
    emb_r = v_r * H
    head_r = 0 if shape["tie_word_embeddings"] else v_r * H
    params_gpu = emb_r + head_r + L * per_layer_gpu_params + H
    bytes_gpu = (emb_r + head_r + H) * dtype_bytes + L * per_layer_gpu_bytes
    _, per_layer_bytes = layer(nh, nkv, I)
    bytes_total = (emb + head + H) * dtype_bytes + L * per_layer_bytes
    return {
        "total": int(total),
        "embedding": int(emb),
        "lm_head": int(head),
        "per_layer": int(per_layer),
        "num_layers": L,
        "per_gpu": int(params_gpu),
        "bytes_total": int(round(bytes_total)),
        "bytes_per_gpu": int(round(bytes_gpu)),
    }


def activation_bytes(shape: dict, tp: int, kv_r: int, batched_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    H, I, V, hd = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["head_dim"]
    qkv = (shape["num_attention_heads"] // tp + 2 * kv_r) * hd
    act = batched_tokens * (2 * H + qkv + 3 * (I // tp)) * dtype_bytes
    logits = num_seqs * V * 4
    return int(act + logits)


def default_batched_tokens(max_model_len: int) -> int:
    """Prefill token budget per step: a whole max_model_len prompt up to 8192, never below 2048."""
    return max(2048, min(max_model_len, 8192))


def core(shape: dict, gpu: dict, *, tp: int, dtype: str, quant: str | None, kv_dtype: str, max_model_len: int,
         block_size: int, util: float, target: int | None, group: int = INT4_GROUP_SIZE,
         batched_tokens: int | None = None) -> dict:
    """All memory arithmetic for one configuration (no advice); also reused to test candidate fixes."""
    kv_r = check_tp(shape, tp)
    db = DTYPE_BYTES[dtype]
    kvb = db if kv_dtype == "auto" else KV_DTYPE_BYTES[kv_dtype]
    w = weights(shape, db, quant, tp, group)
    L, hd = shape["num_layers"], shape["head_dim"]
    kv_tok = 2 * L * shape["num_kv_heads"] * hd * kvb
    kv_tok_gpu = 2 * L * kv_r * hd * kvb
    bt = batched_tokens or default_batched_tokens(max_model_len)
    act_seqs = max(MAX_NUM_SEQS_CAP, target or 0)
    act = activation_bytes(shape, tp, kv_r, bt, act_seqs, db)
    usable = gpu["memory_bytes"] * util
    budget = usable - w["bytes_per_gpu"] - act - OVERHEAD_BYTES
    block_bytes = block_size * kv_tok_gpu
    num_blocks = max(0, int(budget // block_bytes)) if budget > 0 else 0
    blocks_per_seq = math.ceil(max_model_len / block_size)
    full_seqs = num_blocks // blocks_per_seq
    if budget <= 0:
        status = "oom_weights"
    elif full_seqs < 1:
        status = "oom_kv"
    elif target and full_seqs < target:
        status = "ok_below_target"
    else:
        status = "ok"
    return {
        "block_size": block_size, "kv_heads_per_gpu": kv_r, "dtype_bytes": db, "kv_dtype_bytes": kvb, "weights": w,
        "kv_bytes_per_token": kv_tok, "kv_bytes_per_token_per_gpu": kv_tok_gpu,
        "batched_tokens": bt, "activation_bytes": act, "usable_bytes": usable, "kv_budget_bytes": budget,
        "num_blocks": num_blocks, "blocks_per_sequence": blocks_per_seq, "full_seqs": full_seqs, "status": status,
    }


def _fits(r: dict, need: int) -> bool:
    return r["kv_budget_bytes"] > 0 and r["full_seqs"] >= need


def _fit_len(attempt, r: dict, need: int, block_size: int) -> int:
    """Longest max_model_len (a multiple of block_size) at which `need` sequences fit, or 0."""
    if r["kv_budget_bytes"] <= 0 or r["num_blocks"] <= 0:
        return 0
    fit_len = (r["num_blocks"] // need) * block_size
    for _ in range(8):  # a shorter max_model_len also shrinks the activation estimate, so it only gets better
        if fit_len <= 0:
            return 0
        t = attempt(max_model_len=fit_len)
        if t and _fits(t, need):
            return fit_len
        fit_len -= block_size
    return 0


def suggest_fixes(shape: dict, gpu_name: str, gpus: dict, opts: dict, r: dict) -> list[dict]:
    """Concrete changes that make `need` full-length sequences fit (1 when out of memory, else the target).

    Each fix changes one thing; when that thing lets the weights load but max_model_len still does not fit,
    the fix also carries the max_model_len that would.
    """
    need = 1 if r["status"] in ("oom_weights", "oom_kv") else (opts["target"] or 1)
    gpu = gpus[gpu_name]
    fixes: list[dict] = []

    def attempt(**changes):
        o = {**opts, **changes}
        try:
            return core(shape, gpus[o.pop("gpu_name", gpu_name)], **o)
        except PlanError:
            return None

    def evaluate(change: str, flags: str, desc, **changes) -> dict | None:
        """The fix these changes give: full fit, or full fit once max_model_len is cut too, or None."""
        t = attempt(**changes)
        if t is None or t["kv_budget_bytes"] <= 0 or t["num_blocks"] <= 0:
            return None
        d = desc(t) if callable(desc) else desc
        if _fits(t, need):
            return {"change": change, "flags": flags, "full": True,
                    "result": f"{d}{t['full_seqs']} sequence(s) of {opts['max_model_len']} tokens fit"}
        fl = _fit_len(lambda **c: attempt(**{**changes, **c}), t, need, opts["block_size"])
        if fl <= 0:
            return None
        return {"change": change + "+max_model_len", "flags": f"{flags} --max-model-len {fl}", "full": False,
                "result": f"{d}{need} sequence(s) of {fl} tokens fit"}

    def best(candidates) -> bool:
        """Append the first candidate that fits at full length, else the first that fits at all."""
        first = None
        for args in candidates:
            f = evaluate(*args[:3], **args[3])
            if f and f["full"]:
                first = f
                break
            first = first or f
        if first:
            fixes.append({k: v for k, v in first.items() if k != "full"})
        return first is not None

    def consider(change: str, flags: str, desc, **changes) -> bool:
        return best([(change, flags, desc, changes)])

    # 1. shorter max_model_len (only if the weights load at all)
    fl = _fit_len(attempt, r, need, opts["block_size"])
    if fl > 0:
        fixes.append({"change": "max_model_len", "flags": f"--max-model-len {fl}",
                      "result": f"{need} sequence(s) of {fl} tokens fit"})
    # 2. raise gpu memory utilization (only the full-length fit counts here)
    if opts["util"] < UTILIZATION_MAX:
        for i in range(1, 100):
            u = round(opts["util"] + 0.01 * i, 2)
            if u > UTILIZATION_MAX:
                break
            t = attempt(util=u)
            if t and _fits(t, need):
                fixes.append({"change": "gpu_memory_utilization", "flags": f"--gpu-memory-utilization {u:.2f}",
                              "result": f"{t['full_seqs']} sequence(s) of {opts['max_model_len']} tokens fit"})
                break
    # 3. fp8 KV cache
    if KV_DTYPE_BYTES.get(opts["kv_dtype"], 2) > 1:
        consider("kv_cache_dtype", "--kv-cache-dtype fp8", "", kv_dtype="fp8")
    # 4. weight quantization, mildest first
    order = ("fp8", "int8", "int4")
    start = order.index(opts["quant"]) + 1 if opts["quant"] in order else 0
    quants = [q for q in order[start:] if q != "fp8" or gpu.get("fp8_tflops")]
    best([("quantization", f"--quantization {q}", lambda t: f"weights {t['weights']['bytes_per_gpu'] / GB:.1f} GB per GPU; ",
           {"quant": q}) for q in quants])
    # 5. more tensor parallelism on the same GPU; if no TP size alone loads the weights, TP plus quantization
    tps = [tp for tp in TP_CANDIDATES if tp > opts["tp"] and not _tp_problem(shape, tp)]
    if not best([("tensor_parallel_size", f"--tensor-parallel-size {tp}", f"{tp} x {gpu_name}: ", {"tp": tp})
                 for tp in tps]):
        best([("tensor_parallel_size+quantization", f"--tensor-parallel-size {tp} --quantization {q}",
               f"{tp} x {gpu_name}, {q}: ", {"tp": tp, "quant": q})
              for tp in [opts["tp"], *tps] for q in quants])
    # 6. a bigger GPU (same TP size), smallest first
    bigger = [n for n in sorted(gpus, key=lambda n: (gpus[n]["memory_bytes"], -gpus[n]["bandwidth_gb_s"]))
              if gpus[n]["memory_bytes"] > gpu["memory_bytes"]]
    best([("gpu", f"--gpu {n}", f"{opts['tp']} x {n}: ", {"gpu_name": n}) for n in bigger])
    return fixes


def decode_ceiling(r: dict, gpu: dict, context_len: int, concurrency: int) -> dict:
    bw = gpu["bandwidth_gb_s"] * GB
    w = r["weights"]["bytes_per_gpu"]
    kv_seq = context_len * r["kv_bytes_per_token_per_gpu"]
    single = bw / (w + kv_seq)
    # only sequences whose KV is resident can decode together: cap the concurrency by the KV blocks
    blocks_per_ctx = math.ceil(context_len / r["block_size"])
    resident = min(concurrency, r["num_blocks"] // blocks_per_ctx)
    step_bytes = w + resident * kv_seq
    per_seq = bw / step_bytes if resident else 0.0
    return {
        "bandwidth_bytes_per_s": int(bw),
        "context_len": context_len,
        "single_sequence_tokens_per_s": round(single, 1),
        "bytes_per_step_single": int(w + kv_seq),
        "target_concurrency": concurrency,
        "resident_concurrency": resident,
        "per_sequence_tokens_per_s_at_target": round(per_seq, 1),
        "aggregate_tokens_per_s_at_target": round(per_seq * resident, 1),
        "bytes_per_step_at_target": int(step_bytes),
    }


def build_plan(args) -> dict:
    gpus = load_gpus()
    gpu_name, gpu = find_gpu(args.gpu, gpus)
    cfg_path, cfg = load_config(args.model)
    shape = model_shape(cfg)
    warnings: list[str] = []

    dtype, note = resolve_dtype(_DTYPE_ALIASES.get(args.dtype, args.dtype), shape["config_dtype"])
    if note:
        warnings.append(note)
    quant, group, note = resolve_quantization(args.quantization, shape["quantization_config"])
    if note:
        warnings.append(note)
    if quant == "fp8" and not gpu.get("fp8_tflops"):
        warnings.append(f"{gpu_name} has no FP8 tensor cores: fp8 weights run as weight-only (dequantized) kernels")
    kv_dtype = args.kv_cache_dtype
    if kv_dtype != "auto" and kv_dtype not in KV_DTYPE_BYTES:
        raise PlanError(f"unknown --kv-cache-dtype {kv_dtype!r}; choose auto, {', '.join(KV_DTYPE_BYTES)}")
    if shape["model_type"] not in KNOWN_MODEL_TYPES:
        warnings.append(f"model_type {shape['model_type']!r} is not one plan knows "
                        f"({', '.join(KNOWN_MODEL_TYPES)}); counted as a Llama-style decoder")

    tp = args.tensor_parallel_size
    check_tp(shape, tp)
    if not 0 < args.gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.block_size < 1:
        raise PlanError("--block-size must be >= 1")
    max_pos = shape["max_position_embeddings"]
    max_model_len = args.max_model_len or max_pos or 2048
    if max_model_len < 1:
        raise PlanError("--max-model-len must be >= 1")
    if max_pos and max_model_len > max_pos:
        warnings.append(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_pos}; "
                        "the engine will refuse it unless RoPE scaling is configured")
    if args.target_concurrency is not None and args.target_concurrency < 1:
        raise PlanError("--target-concurrency must be >= 1")
    target = args.target_concurrency
    context_len = args.context_len or max_model_len
    if context_len < 1:
        raise PlanError("--context-len must be >= 1")

    opts = dict(tp=tp, dtype=dtype, quant=quant, kv_dtype=kv_dtype, max_model_len=max_model_len,
                block_size=args.block_size, util=args.gpu_memory_utilization, target=target, group=group)
    r = core(shape, gpu, **opts)
    status = r["status"]
    fixes = suggest_fixes(shape, gpu_name, gpus, opts, r) if status != "ok" else []

    kv_tokens = r["num_blocks"] * args.block_size
    gb = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    if status == "oom_weights":
        need = r["weights"]["bytes_per_gpu"] + r["activation_bytes"] + OVERHEAD_BYTES
        msg = (f"OUT OF MEMORY: weights ({gb(r['weights']['bytes_per_gpu'])}) + activations and overhead "
               f"({gb(r['activation_bytes'] + OVERHEAD_BYTES)}) = {gb(need)} per GPU exceed "
               f"{gb(r['usable_bytes'])} usable on {gpu_name}; the model does not load")
    elif status == "oom_kv":
        msg = (f"OUT OF MEMORY: the weights load, but the KV cache ({kv_tokens} tokens) cannot hold one "
               f"{max_model_len}-token sequence")
    elif status == "ok_below_target":
        msg = (f"FITS, but only {r['full_seqs']} sequence(s) of {max_model_len} tokens are resident at once, below "
               f"--target-concurrency {target}; more will run only if sequences are shorter "
               f"(average <= {kv_tokens // target} tokens), else the engine preempts")
    else:
        msg = f"FITS: {r['full_seqs']} sequence(s) of {max_model_len} tokens at once ({kv_tokens} KV tokens)"
    if fixes and status in ("oom_weights", "oom_kv"):
        msg += "; fix: " + " or ".join(f"`{f['flags']}`" for f in fixes[:2]) + " (more below)" * (len(fixes) > 2)

    fits = status in ("ok", "ok_below_target")
    rec_util = args.gpu_memory_utilization
    for f in fixes:
        if f["change"] == "gpu_memory_utilization" and not fits:
            rec_util = float(f["flags"].split()[-1])
    max_num_seqs = max(1, min(MAX_NUM_SEQS_CAP, r["full_seqs"])) if fits else None
    if fits and target:
        max_num_seqs = target
    concurrency = target or max_num_seqs or 1
    recommended = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(r["batched_tokens"], max_num_seqs or 0) if fits else None,
        "gpu_memory_utilization": rec_util,
        "max_model_len": max_model_len if fits else next(
            (int(f["flags"].split()[-1]) for f in fixes if f["change"] == "max_model_len" and f["flags"]), None),
        "flags": None,
    }
    if fits:
        recommended["flags"] = (f"--max-model-len {max_model_len} --max-num-seqs {recommended['max_num_seqs']} "
                                f"--max-num-batched-tokens {recommended['max_num_batched_tokens']} "
                                f"--gpu-memory-utilization {rec_util:.2f}"
                                + (f" --tensor-parallel-size {tp}" if tp > 1 else ""))
        if r["batched_tokens"] < max_model_len:
            warnings.append(f"max_num_batched_tokens {r['batched_tokens']} < max_model_len {max_model_len}: prompts "
                            "longer than that need chunked prefill")
    if target and target > MAX_NUM_SEQS_CAP:
        warnings.append(f"--target-concurrency {target} is above the usual max-num-seqs cap {MAX_NUM_SEQS_CAP}")

    peak = gpu["fp8_tflops"] if quant == "fp8" and gpu.get("fp8_tflops") else gpu["bf16_tflops"]
    w = r["weights"]
    plan = {
        "model": {
            "config": cfg_path,
            **{k: shape[k] for k in ("model_type", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                                     "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "qkv_bias",
                                     "max_position_embeddings")},
        },
        "settings": {
            "gpu": gpu_name, "tensor_parallel_size": tp, "dtype": dtype, "quantization": quant,
            "int4_group_size": group if quant == "int4" else None,
            "kv_cache_dtype": kv_dtype if kv_dtype != "auto" else dtype, "max_model_len": max_model_len,
            "block_size": args.block_size, "gpu_memory_utilization": args.gpu_memory_utilization,
            "target_concurrency": target, "context_len": context_len,
        },
        "gpu": {"name": gpu_name, "memory_bytes": gpu["memory_bytes"], "bandwidth_gb_s": gpu["bandwidth_gb_s"],
                "bf16_tflops": gpu["bf16_tflops"], "fp8_tflops": gpu.get("fp8_tflops"), "note": gpu.get("note")},
        "params": {k: w[k] for k in ("total", "embedding", "lm_head", "per_layer", "num_layers", "per_gpu")},
        "weights": {"bytes_total": w["bytes_total"], "bytes_per_gpu": w["bytes_per_gpu"],
                    "dtype_bytes": r["dtype_bytes"]},
        "kv_cache": {
            "bytes_per_token": r["kv_bytes_per_token"],
            "bytes_per_token_per_gpu": r["kv_bytes_per_token_per_gpu"],
            "kv_heads_per_gpu": r["kv_heads_per_gpu"],
            "dtype_bytes": r["kv_dtype_bytes"],
            "bytes_per_sequence": r["kv_bytes_per_token"] * max_model_len,
            "bytes_for_target_concurrency": r["kv_bytes_per_token"] * max_model_len * target if target else None,
        },
        "memory": {
            "gpu_bytes": gpu["memory_bytes"],
            "usable_bytes": int(r["usable_bytes"]),
            "weights_bytes": w["bytes_per_gpu"],
            "activation_bytes": r["activation_bytes"],
            "overhead_bytes": OVERHEAD_BYTES,
            "kv_budget_bytes": int(r["kv_budget_bytes"]),
        },
        "capacity": {
            "block_size": args.block_size,
            "num_blocks": r["num_blocks"],
            "kv_tokens": kv_tokens,
            "blocks_per_sequence": r["blocks_per_sequence"],
            "max_full_length_sequences": r["full_seqs"],
        },
        "verdict": {"fits": fits, "status": status, "message": msg},
        "fixes": fixes,
        "recommended": recommended,
        "decode": decode_ceiling(r, gpu, context_len, concurrency),
        "prefill": {
            "peak_tflops_per_gpu": peak,
            "tokens_per_s_ceiling": round(tp * peak * 1e12 / (2 * w["total"]), 1),
        },
        "warnings": warnings,
        "formulas": FORMULAS,
    }
    return plan


# --------------------------------------------------------------------------- output

def _num(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def format_text(p: dict) -> str:
    m, s, w, kv, mem, cap, dec = p["model"], p["settings"], p["weights"], p["kv_cache"], p["memory"], p["capacity"], \
        p["decode"]
    g = lambda b: f"{b / GB:8.2f} GB"  # noqa: E731
    tp = s["tensor_parallel_size"]
    q = s["quantization"] or "none"
    lines = [
        f"pagedserve plan: {Path(m['config']).parent.name or m['config']} ({m['model_type']}) on "
        f"{tp} x {s['gpu']}",
        "",
        "Model",
        f"  shape                  {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads /"
        f" {m['num_kv_heads']} kv heads x {m['head_dim']}, intermediate {m['intermediate_size']}, vocab {m['vocab_size']}"
        f"{', tied embeddings' if m['tie_word_embeddings'] else ''}",
        f"  parameters             {_num(p['params']['total'])}  (embeddings {_num(p['params']['embedding'])}, "
        f"lm_head {_num(p['params']['lm_head'])}, {m['num_layers']} x {_num(p['params']['per_layer'])} per layer)",
        f"  weights                {w['bytes_total'] / GB:.2f} GB total ({s['dtype']}, quantization {q})"
        + (f", {w['bytes_per_gpu'] / GB:.2f} GB per GPU" if tp > 1 else ""),
        f"  KV cache per token     {kv['bytes_per_token']:,} B  (2 x {m['num_layers']} layers x {m['num_kv_heads']} kv heads"
        f" x {m['head_dim']} x {kv['dtype_bytes']} B {s['kv_cache_dtype']})"
        + (f"; {kv['bytes_per_token_per_gpu']:,} B per GPU ({kv['kv_heads_per_gpu']} kv head(s) per rank)"
           if tp > 1 else ""),
        f"  KV per sequence        {kv['bytes_per_sequence'] / GB:.2f} GB at {s['max_model_len']} tokens"
        + (f"; x {s['target_concurrency']} sequences = {kv['bytes_for_target_concurrency'] / GB:.2f} GB"
           if s["target_concurrency"] else ""),
        "",
        f"Memory per GPU ({s['gpu']}: {p['gpu']['memory_bytes'] / GB:.2f} GB, {p['gpu']['bandwidth_gb_s']} GB/s)",
        f"  GPU memory x {s['gpu_memory_utilization']:.2f}     {g(mem['usable_bytes'])}",
        f"  - weights              {g(mem['weights_bytes'])}",
        f"  - activations          {g(mem['activation_bytes'])}",
        f"  - overhead             {g(mem['overhead_bytes'])}",
        f"  = KV cache budget      {g(mem['kv_budget_bytes'])}",
        f"  KV blocks              {cap['num_blocks']:,} x {cap['block_size']} tokens = {cap['kv_tokens']:,} tokens; "
        f"{cap['blocks_per_sequence']} blocks per {s['max_model_len']}-token sequence -> "
        f"{cap['max_full_length_sequences']} at once",
        "",
        f"Verdict: {p['verdict']['message']}",
    ]
    if p["fixes"]:
        lines.append("What to change (any one line):")
        for f in p["fixes"]:
            lines.append(f"  {f['flags']:46s} {f['result']}")
    rec = p["recommended"]
    if rec["flags"]:
        lines += ["", "Recommended", f"  pagedserve serve ... {rec['flags']}"]
    if rec["flags"]:
        lines.append(f"  (--max-num-seqs {rec['max_num_seqs']}: "
                     + ("your --target-concurrency" if s["target_concurrency"] else
                        f"every running sequence can grow to {s['max_model_len']} tokens without preemption; "
                        f"if requests average N tokens, up to {cap['kv_tokens']:,} / N can run") + ")")
    if p["verdict"]["fits"]:
        lines += [
            "",
            f"Decode ceiling (memory-bandwidth bound, context {dec['context_len']} tokens per sequence)",
            f"  1 sequence             <= {dec['single_sequence_tokens_per_s']:,.1f} tok/s "
            f"({dec['bytes_per_step_single'] / GB:.2f} GB read per step per GPU)",
        ]
        if dec["resident_concurrency"]:
            extra = (f" (only {dec['resident_concurrency']} of {dec['target_concurrency']} fit at this context)"
                     if dec["resident_concurrency"] < dec["target_concurrency"] else "")
            lines.append(f"  {dec['resident_concurrency']:>3} sequences          <= "
                         f"{dec['per_sequence_tokens_per_s_at_target']:,.1f} tok/s each, "
                         f"{dec['aggregate_tokens_per_s_at_target']:,.1f} tok/s aggregate{extra}")
        lines.append(f"Prefill ceiling          <= {p['prefill']['tokens_per_s_ceiling']:,.0f} tok/s "
                     f"({p['prefill']['peak_tflops_per_gpu']} TFLOP/s per GPU at 100 % MFU)")
    if p["warnings"]:
        lines += ["", "Notes"] + [f"  - {x}" for x in p["warnings"]]
    lines += ["", "Formulas"] + [f"  {k}: {v}" for k, v in p["formulas"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI

def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: memory, KV blocks, concurrency and decode ceiling for a model on a GPU",
        description="Estimate whether a Llama-family model fits a GPU, how many sequences run at once, which "
                    "engine flags to use, and the memory-bandwidth ceiling on decode speed. Reads config.json "
                    "only; no weights, no GPU needed.",
    )
    p.add_argument("--model", required=True, help="model directory containing config.json, or a config.json path")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H100-80GB, A100-40GB, L4 (unknown names list the known)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32", "half", "bf16"],
                   help="model dtype (auto: the checkpoint's; float32 checkpoints run in float16)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS) + ["none"],
                   help="weight quantization of the linear layers (default: from config quantization_config, else none)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (= model dtype), " + ", ".join(KV_DTYPE_BYTES))
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs per model replica")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length per sequence (default: config max_position_embeddings)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory the engine may use")
    p.add_argument("--target-concurrency", type=int, default=None,
                   help="sequences you want running at once (default: the recommended --max-num-seqs)")
    p.add_argument("--context-len", type=int, default=None,
                   help="tokens of context per sequence for the decode ceiling (default: max-model-len, worst case)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        plan = build_plan(args)
    except PlanError as e:
        print(f"pagedserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_text(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
