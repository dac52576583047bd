"""Offline engine throughput on the standard workloads, with transformers `generate` beside it.

Runs are alternated (ours, baseline, ours, ...) in one process and run; medians are reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def add_arguments(p) -> None:
    from pagedserve.engine.args import add_engine_args

    p.add_argument("--workload", default="W1", help="W1 | W2 | W3 (see benchmarks/README.md)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N requests of the workload")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run transformers generate (static batches, left padding) and print the ratio")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="alternated runs per engine; medians are reported")
    p.add_argument("--profile", action="store_true", help="print where each engine step's time goes")
    p.add_argument("--output-json", default=None, help="write the figures to this file")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the GEMM ceiling on the model's layer shapes after the runs and print the "
                        "fraction of it the engine achieved (default: on)")
    add_engine_args(p)
    p.set_defaults(model="small")


def matmul_params(spec) -> tuple[int, int]:
    """(decoder-layer matmul parameters, LM-head parameters)."""
    h, hd = spec.hidden_size, spec.head_dim
    per_layer = h * hd * (spec.num_heads * 2 + spec.num_kv_heads * 2) + 3 * h * spec.intermediate_size
    return per_layer * spec.num_layers, h * spec.vocab_size


def _run_ours(llm, wl, profile: bool) -> dict:
    from pagedserve.engine.profiler import StepProfiler
    from pagedserve.sampling_params import SamplingParams

    eng = llm.llm_engine
    eng.block_manager.reset_prefix_cache()  # every run starts cold
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    q0, h0 = eng.block_manager.query_tokens, eng.block_manager.hit_tokens
    eng.profiler = StepProfiler() if profile else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == wl.output_tokens, f"engine produced {got} tokens, expected {wl.output_tokens}"
    res = {"seconds": dt, "prefix_cache_hit_tokens": eng.block_manager.hit_tokens - h0,
           "prefix_cache_query_tokens": eng.block_manager.query_tokens - q0,
           "prefill_tokens_computed": wl.prompt_tokens - (eng.block_manager.hit_tokens - h0)}
    if profile:
        res["profile"] = eng.profiler.as_dict()
        res["profile_text"] = eng.profiler.report()
    eng.profiler = None
    return res


def _run_hf(model_dir, wl, dtype, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    m.eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(wl.prompts), batch_size):
            batch = wl.prompts[i:i + batch_size]
            new = max(wl.output_lens[i:i + batch_size])
            width = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(batch):  # left padding
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return {"seconds": time.perf_counter() - t0}


def run(args) -> int:
    import logging

    import torch

    from pagedserve.bench.workloads import MODEL_SHAPES, Workload, bench_model_dir, make_workload
    from pagedserve.engine.args import config_from_args
    from pagedserve.errors import ConfigError
    from pagedserve.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    model_dir = bench_model_dir(args.model) if args.model in MODEL_SHAPES else args.model
    args.model = str(model_dir)
    try:
        wl = make_workload(args.workload, args.num_prompts)
        cfg = config_from_args(args)
        t0 = time.perf_counter()
        llm = LLM.from_config(cfg)
    except (ConfigError, ValueError) as e:
        print(f"pagedserve bench throughput: error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    # timed runs see the steady state of a long-running engine: the KV pool's pages resident (on
    # the CPU they are faulted in by a background thread, see runner/cpu_memory.py), as an engine
    # that zeroes its pool at start-up has them
    t1 = time.perf_counter()
    llm.llm_engine.kv_cache.wait_resident()
    resident_s = time.perf_counter() - t1
    spec = llm.llm_engine.spec
    dtype = llm.llm_engine.dtype
    # warm-up: first calls pay for lazy initialisation in torch / oneDNN
    _run_ours(llm, Workload("warmup", [p[:32] for p in wl.prompts[:4]], [4] * len(wl.prompts[:4])), False)

    ours, hf = [], []
    for r in range(args.repeats):
        ours.append(_run_ours(llm, wl, args.profile and r == args.repeats - 1))
        if args.baseline == "hf":
            hf.append(_run_hf(model_dir, wl, dtype, args.hf_batch_size))

    layer_p, head_p = matmul_params(spec)
    flops = wl.prompt_tokens * 2 * layer_p + wl.output_tokens * 2 * (layer_p + head_p)

    def summary(runs):
        s = statistics.median(r["seconds"] for r in runs)
        return {"seconds_median": s, "seconds_all": [r["seconds"] for r in runs],
                "output_tokens_per_s": wl.output_tokens / s,
                "total_tokens_per_s": (wl.prompt_tokens + wl.output_tokens) / s,
                "requests_per_s": len(wl.prompts) / s, "achieved_gflops": flops / s / 1e9}

    result = {
        "workload": wl.name, "model": str(model_dir), "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "requests": len(wl.prompts), "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens, "load_seconds": load_s, "kv_pool_resident_wait_seconds": resident_s,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "pagedserve": {**summary(ours), "prefill_tokens_computed": ours[-1]["prefill_tokens_computed"],
                       "prefix_cache_hit_tokens": ours[-1]["prefix_cache_hit_tokens"]},
    }
    if hf:
        result["hf"] = summary(hf)
        result["ratio_output_tokens_per_s"] = result["pagedserve"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"]
    if args.profile:
        result["profile"] = ours[-1]["profile"]
    screen = llm.llm_engine.runner.greedy_head
    if screen is not None and screen.rows:
        result["pagedserve"]["greedy_screen"] = {
            "kind": screen.kind, "rows": screen.rows, "exact_logits_per_row": screen.computed / screen.rows,
            "vocab_size": spec.vocab_size}
    if args.ceiling:
        from pagedserve.bench.ceiling import gemm_ceiling

        ceiling = gemm_ceiling(spec, dtype, llm.llm_engine.device)
        result["gemm_ceiling_gflops"] = ceiling["gflops"]
        result["gemm_ceiling_by_rows"] = ceiling["by_rows"]
        result["ceiling_fraction"] = result["pagedserve"]["achieved_gflops"] / ceiling["gflops"]
        result["torch_gemm_ceiling_gflops"] = ceiling["torch_gflops"]
        result["torch_gemm_ceiling_by_rows"] = ceiling["torch_by_rows"]
        result["torch_ceiling_fraction"] = result["pagedserve"]["achieved_gflops"] / ceiling["torch_gflops"]
    _print(result, ours[-1].get("profile_text"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print(r: dict, profile_text: str | None) -> None:
    print(f"\n{r['workload']}: {r['requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens; "
          f"model {r['model']} ({r['dtype']}, {r['threads']} threads, prefix caching "
          f"{'on' if r['enable_prefix_caching'] else 'off'})")
    print(f"{'engine':<12} {'wall s':>9} {'out tok/s':>11} {'total tok/s':>12} {'req/s':>8} {'GFLOP/s':>9}")
    for name in ("pagedserve", "hf"):
        if name in r:
            x = r[name]
            print(f"{name:<12} {x['seconds_median']:9.2f} {x['output_tokens_per_s']:11.1f} {x['total_tokens_per_s']:12.1f} "
                  f"{x['requests_per_s']:8.2f} {x['achieved_gflops']:9.1f}")
    if "ratio_output_tokens_per_s" in r:
        print(f"ratio pagedserve / hf (output tok/s): {r['ratio_output_tokens_per_s']:.2f}x")
    p = r["pagedserve"]
    if "gemm_ceiling_gflops" in r:
        rows = ", ".join(f"{m} rows {g:.1f}" for m, g in r["gemm_ceiling_by_rows"].items())
        print(f"GEMM ceiling on the model's shapes: {r['gemm_ceiling_gflops']:.1f} GFLOP/s ({rows}); "
              f"pagedserve achieved {100 * r['ceiling_fraction']:.1f} % of it")
        if "torch_gemm_ceiling_gflops" in r and r["torch_gemm_ceiling_gflops"] < r["gemm_ceiling_gflops"]:
            print(f"  torch's own GEMMs alone (linear, oneDNN prepacked): {r['torch_gemm_ceiling_gflops']:.1f} GFLOP/s; "
                  f"pagedserve achieved {100 * r['torch_ceiling_fraction']:.1f} % of that")
    print(f"prefill tokens computed: {p['prefill_tokens_computed']} of {r['prompt_tokens']} "
          f"(prefix-cache hits {p['prefix_cache_hit_tokens']} tokens)")
    if "greedy_screen" in p:
        g = p["greedy_screen"]
        print(f"greedy LM-head screen ({g['kind']}): {g['rows']} rows, {g['exact_logits_per_row']:.1f} logits computed "
              f"exactly per row of {g['vocab_size']} (GFLOP/s above count the whole head)")
    if profile_text:
        print(profile_text)
