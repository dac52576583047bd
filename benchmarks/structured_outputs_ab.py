"""Structured outputs against none: decode speed with a JSON schema on every request, and the
schema compile time (first and cached).

W1-like load: N prompts of 128 random token ids, greedy. Each round runs the batch twice on one
engine, unconstrained and with a JSON schema on every request, alternating which goes first. A
constrained request may finish early (its JSON is complete), so the figure compared is TPOT: per
request (last token time - first token time) / (output tokens - 1), median over requests, then the
median over rounds, and its ratio to the unconstrained run. Output tokens per second of the whole
batch are printed beside it.

  python benchmarks/structured_outputs_ab.py                       # default model, 64 prompts, 3 rounds
  python benchmarks/structured_outputs_ab.py --model DIR --num-prompts 256 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

# an open-ended schema: a list of at least 64 records, so a constrained output runs to max_tokens like
# an unconstrained one (with no minimum, "[]" completes it in two tokens)
RECORDS = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "score": {"type": "number"},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    },
}


def fifty_field_schema() -> dict:
    kinds = [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 32},
             {"type": "number"}, {"type": "boolean"}, {"enum": ["x", "y", "z"]},
             {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def run(llm, prompts, max_tokens: int, schema) -> tuple[float, float, int]:
    from pagedserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=schema is None,
                        structured_outputs={"json": schema} if schema is not None else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    tpots, total = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        total += n
        m = o.metrics
        if n > 1 and m is not None and m.last_token_time and m.first_token_time:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    return statistics.median(tpots), total / wall, total


def compile_times(llm) -> None:
    from pagedserve.structured import StructuredOutputsParams
    from pagedserve.structured.grammar import GrammarCompiler

    eng = llm.llm_engine
    comp = GrammarCompiler(eng.tokenizer, eng.spec.vocab_size, lambda: eng.validator.eos_ids)
    t0 = time.perf_counter()
    comp._tokenizer()
    t1 = time.perf_counter()
    so = StructuredOutputsParams(json=fifty_field_schema())
    comp.matcher(so)
    t2 = time.perf_counter()
    comp.matcher(StructuredOutputsParams(json=json.loads(json.dumps(fifty_field_schema()))))
    t3 = time.perf_counter()
    print(f"tokenizer for llguidance (once per engine): {(t1 - t0) * 1e3:.1f} ms")
    print(f"50-field schema compile: first {(t2 - t1) * 1e3:.2f} ms, cached {(t3 - t2) * 1e3:.3f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the built-in default)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import numpy as np

    from pagedserve import LLM

    llm = LLM(model=args.model, seed=0)
    vocab = llm.llm_engine.spec.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, size=128).tolist()} for _ in range(args.num_prompts)]
    compile_times(llm)
    run(llm, prompts[:4], 8, None)  # warm-up (native kernels, allocator)
    run(llm, prompts[:4], 8, RECORDS)
    res = {"none": [], "json_schema": []}
    for r in range(args.rounds):
        order = [("none", None), ("json_schema", RECORDS)]
        if r % 2:
            order.reverse()
        for name, schema in order:
            tpot, tps, total = run(llm, prompts, args.max_tokens, schema)
            res[name].append((tpot, tps, total))
            print(f"round {r}: {name:12s} TPOT {tpot * 1e3:7.2f} ms  {tps:8.1f} tok/s  ({total} tokens)")
    base = statistics.median(t for t, _, _ in res["none"])
    for name, rows in res.items():
        tpot = statistics.median(t for t, _, _ in rows)
        tps = statistics.median(x for _, x, _ in rows)
        print(f"{name:12s} median TPOT {tpot * 1e3:7.2f} ms  ratio {tpot / base:.3f}  {tps:8.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
