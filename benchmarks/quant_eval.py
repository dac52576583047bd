"""Accuracy, weight memory and batch-1 decode speed of each quantization method, in one table.

For each (model, --quantization) row: perplexity over held-out text (`pagedserve eval perplexity`'s
own code), greedy agreement with the model's full-precision run over 64 prompts cut from the same
text (share of prompts whose N greedy tokens are identical, and the mean share of each continuation
that matches before the first difference), the engine's weight bytes, and batch-1 decode tok/s
(median of --repeats runs, rows alternated) beside the memory floor (weight bytes ÷ --bandwidth-gbs).

  python benchmarks/quant_eval.py --model ../shared/models/stories260K --methods none int8 w8a8 fp8
  python benchmarks/quant_eval.py --model SmolLM2.Q4_1.gguf --methods none gguf
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.eval.perplexity import evaluate


def _prompts(text: str, tok, n: int, length: int) -> list[list[int]]:
    ids = tok.encode(text)
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step:i * step + length] for i in range(n)]


def _greedy(llm, prompts, new_tokens):
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def _decode_rate(llm, prompt, new_tokens) -> float:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    return len(out.outputs[0].token_ids) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--methods", nargs="+", required=True, help="--quantization values; 'none' is the reference")
    ap.add_argument("--text", default="../shared/data/tinystories-valid-sample.txt")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--bandwidth-gbs", type=float, default=25.0, help="memory bandwidth for the floor")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    text = open(args.text, encoding="utf-8").read()

    llms = {m: LLM(model=args.model, quantization=None if m == "default" else m, dtype=args.dtype,
                   max_model_len=512, num_gpu_blocks_override=512) for m in args.methods}
    ref_name = args.methods[0]
    prompts = _prompts(text, llms[ref_name].get_tokenizer(), args.prompts, args.prompt_len)
    ref_tokens = _greedy(llms[ref_name], prompts, args.new_tokens)
    rates: dict[str, list[float]] = {m: [] for m in args.methods}
    for _ in range(args.repeats):  # alternated, so a busy moment of a shared host hits every row
        for m, llm in llms.items():
            rates[m].append(_decode_rate(llm, prompts[0], args.decode_tokens))
    print(f"model {args.model}; reference: --quantization {ref_name}; {args.prompts} prompts of {args.prompt_len} "
          f"tokens, {args.new_tokens} greedy tokens; perplexity windows of {args.window}")
    print("| --quantization | weights MB | perplexity | greedy identical | matching prefix | batch-1 decode tok/s "
          "| floor tok/s |")
    print("|---|---|---|---|---|---|---|")
    for m, llm in llms.items():
        eng = llm.llm_engine
        ppl = evaluate(llm, text, window=args.window).perplexity
        toks = ref_tokens if m == ref_name else _greedy(llm, prompts, args.new_tokens)
        same = sum(a == b for a, b in zip(toks, ref_tokens)) / len(prompts)
        prefix = []
        for a, b in zip(toks, ref_tokens):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            prefix.append(k / len(b))
        floor = args.bandwidth_gbs * 1e9 / eng.weight_bytes
        print(f"| {m} | {eng.weight_bytes / 1e6:.1f} | {ppl:.3f} | {same:.0%} | {statistics.mean(prefix):.0%} | "
              f"{statistics.median(rates[m]):.1f} | {floor:.0f} |")


if __name__ == "__main__":
    main()
