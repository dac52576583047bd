"""Greedy agreement with transformers in bfloat16 (issue #8: measured and reported, not asserted).

In float32 our greedy output is token-identical to transformers (the core tests assert it). In
bfloat16 both engines round differently (fused projections, a different attention kernel, the
order of reductions), so once two candidates are within a bf16 rounding step the paths may part.
This prints, over the first requests of a workload on a benchmark model, how many sequences are
identical end to end and how many leading tokens agree on average (after the first divergence the
contexts differ, so later tokens are not comparable).

  .venv/bin/python benchmarks/bf16_agreement.py [--model small] [--num-prompts 16] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.workloads import bench_model_dir, make_workload

    model_dir = str(bench_model_dir(args.model))
    prompts = [ids[:args.prompt_len] for ids in make_workload("W1", args.num_prompts).prompts]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in
            LLM(model_dir, dtype="bfloat16").generate([{"prompt_token_ids": x} for x in prompts], sp)]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                          min_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[:, ids.shape[1]:].tolist()

    def leading(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    lead = [leading(a, b) for a, b in zip(ours, ref)]
    result = {"model": args.model, "dtype": "bfloat16", "requests": len(prompts), "max_tokens": args.max_tokens,
              "identical_sequences": sum(n == args.max_tokens for n in lead),
              "mean_leading_tokens_agreeing": statistics.mean(lead),
              "first_token_agreement": sum(n > 0 for n in lead) / len(lead)}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
