"""The text table `pagedserve plan` prints."""
from __future__ import annotations

from pathlib import Path

from pagedserve.plan.inputs import GB


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
