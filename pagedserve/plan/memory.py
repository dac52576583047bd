"""The arithmetic of `pagedserve plan`: weight, activation and KV-cache bytes, what fits, fixes for
what does not, and the decode ceiling (formulas in the package docstring)."""
from __future__ import annotations

import math

from pagedserve.plan.inputs import (DTYPE_BYTES, GB, INT4_GROUP_SIZE, KV_DTYPE_BYTES, MAX_NUM_SEQS_CAP, OVERHEAD_BYTES,
                                    TP_CANDIDATES, UTILIZATION_MAX, PlanError)


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
