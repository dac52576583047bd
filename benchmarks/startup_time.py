"""pagedserve start-up: process start to the first token of a 1-token request.

Run with the project venv by benchmarks/compare_vllm_cpu.sh, which passes the process start as
--launch-ts (its `date +%s.%N` just before exec), so interpreter start, imports, model load and
the first engine step all count -- the same span vllm_cpu_runner.py's startup mode measures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

_T_IMPORT = time.time()  # fallback when no --launch-ts is given

# Same ids as STARTUP_PROMPT in vllm_cpu_runner.py (kept separate: that file runs in another venv).
STARTUP_PROMPT = list(range(3, 35))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-space", type=float, default=6.0, help="GiB, as VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--launch-ts", type=float, default=None, help="process start, seconds since the epoch")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    launch = args.launch_ts if args.launch_ts is not None else _T_IMPORT

    from pagedserve import LLM, SamplingParams, __version__

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching,
              kv_cache_space=args.kv_cache_space)
    outs = llm.generate([{"prompt_token_ids": STARTUP_PROMPT}],
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    startup = time.time() - launch
    assert len(outs[0].outputs[0].token_ids) == 1

    import torch

    res = {"mode": "startup", "workload": "startup", "engine": "pagedserve", "engine_version": __version__,
           "binding": "default", "dtype": args.dtype, "model": args.model,
           "enable_prefix_caching": args.enable_prefix_caching, "threads": torch.get_num_threads(),
           "startup_s": startup,
           "launch_ts_from": "argument" if args.launch_ts is not None else "script import"}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
