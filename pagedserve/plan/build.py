"""`build_plan`: one plan (the JSON object `--json` prints) from the command-line arguments."""
from __future__ import annotations

from pagedserve.plan.inputs import (_DTYPE_ALIASES, FORMULAS, GB, KNOWN_MODEL_TYPES, KV_DTYPE_BYTES, MAX_NUM_SEQS_CAP,
                                    OVERHEAD_BYTES, PlanError, find_gpu, gpu_variant_note, load_gpus, model_shape,
                                    resolve_dtype, resolve_quantization)
from pagedserve.plan.model_source import load_model_config
from pagedserve.plan.memory import check_tp, core, decode_ceiling, suggest_fixes


def build_plan(args) -> dict:
    gpus = load_gpus()
    gpu_name, gpu = find_gpu(args.gpu, gpus)
    cfg_path, cfg = load_model_config(args.model)
    shape = model_shape(cfg)
    warnings: list[str] = []
    if (note := gpu_variant_note(args.gpu, gpu_name, gpus)) is not None:
        warnings.append(note)

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
