"""Speculative decoding against plain decoding, alternated, medians.

Copy workload: each prompt asks the model to repeat a passage of held-out text
(../shared/data/tinystories-valid-sample.txt), so the output copies the input (what prompt
lookup and suffix trees are for). Every configuration runs in this one process, each its own
engine; rounds alternate the configurations (rotating who goes first) and give each round new
passages, so no configuration meets a passage twice. Reported: output tokens per second
(end-to-end generate time, prefill included, identical for all configurations), the median over
rounds, its ratio to plain decoding, and the mean acceptance length (tokens per verification).

  python benchmarks/spec_decode_ab.py                          # default model, ngram + suffix, batch 1 and 8
  python benchmarks/spec_decode_ab.py --model ../shared/models/stories260K --plain-prompt \
      --draft /tmp/stories-2layer --methods draft_model --batch 1 8 64
  python benchmarks/spec_decode_ab.py --make-truncated-draft ../shared/models/stories260K /tmp/stories-2layer --layers 2

Greedy decoding; outputs are checked token-identical to the plain run of the same passage.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

_SAMPLE = Path("shared") / "data" / "tinystories-valid-sample.txt"
# ../shared beside the checkout (a worktree may sit one level deeper)
DATA = next((d / _SAMPLE for d in Path(__file__).resolve().parents if (d / _SAMPLE).is_file()), _SAMPLE)


def passages(n: int, words: int) -> list[str]:
    text = DATA.read_text().split()
    return [" ".join(text[i * words:(i + 1) * words]) for i in range(min(n, len(text) // words))]


def make_prompts(llm, texts: list[str], plain: bool) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for t in texts:
        if plain or not tok.chat_template:  # a base model: the passage twice primes it to copy a third time
            ids = tok.encode(f"{t}\n\n{t}\n\n")
        else:
            msg = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{t}"}]
            text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)  # the template writes its own special tokens
        out.append({"prompt_token_ids": ids})
    return out


def make_truncated_draft(src: str, dst: str, layers: int) -> None:
    """A copy of an HF Llama folder that keeps only its first `layers` decoder layers."""
    from safetensors.torch import load_file, save_file

    s, d = Path(src), Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    for f in s.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, d / f.name)
    cfg = json.loads((s / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for f in s.glob("*.safetensors"):
        for k, v in load_file(str(f)).items():
            if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            tensors[k] = v
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {d} ({layers} of {json.loads((s / 'config.json').read_text())['num_hidden_layers']} layers)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target model (default: the built-in default)")
    p.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix", "draft_model"])
    p.add_argument("--draft", default=None, help="draft model folder for draft_model")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--words", type=int, default=60, help="words per passage")
    p.add_argument("--plain-prompt", action="store_true", help="no chat template: the passage twice")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--make-truncated-draft", nargs=2, metavar=("SRC", "DST"))
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    if args.make_truncated_draft:
        make_truncated_draft(*args.make_truncated_draft, args.layers)
        return 0

    from pagedserve import LLM, SamplingParams

    common = dict(model=args.model, dtype=args.dtype, kv_cache_space=1.0, num_threads=args.num_threads,
                  max_num_seqs=max(args.batch))
    specs = {"none": None}
    for m in args.methods:
        cfg = {"method": m, "num_speculative_tokens": args.k}
        if m == "draft_model":
            cfg["model"] = args.draft
        specs[m] = cfg
    engines = {name: LLM(speculative_config=cfg, **common) for name, cfg in specs.items()}
    names = list(engines)
    need = args.rounds * sum(args.batch)
    texts = passages(need, args.words)
    if len(texts) < need:
        print(f"only {len(texts)} passages of {args.words} words; lower --rounds/--batch/--words", file=sys.stderr)
        return 2
    prompts = make_prompts(engines["none"], texts, args.plain_prompt)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rates = {(n, b): [] for n in names for b in args.batch}
    accept = {(n, b): [0, 0] for n in names for b in args.batch}  # verifications, accepted drafts
    mismatches = 0
    at = 0
    for r in range(args.rounds):
        for b in args.batch:
            batch = prompts[at:at + b]
            at += b
            order = names[r % len(names):] + names[:r % len(names)]
            outs = {}
            for n in order:
                eng = engines[n].llm_engine
                before = eng.stats().spec_decode
                t0 = time.perf_counter()
                res = engines[n].generate(batch, sp)
                dt = time.perf_counter() - t0
                outs[n] = [o.outputs[0].token_ids for o in res]
                rates[(n, b)].append(sum(len(t) for t in outs[n]) / dt)
                after = eng.stats().spec_decode
                if after is not None:
                    accept[(n, b)][0] += after.num_drafts - before.num_drafts
                    accept[(n, b)][1] += after.num_accepted_tokens - before.num_accepted_tokens
            mismatches += sum(outs[n] != outs["none"] for n in names)
    print(f"model {engines['none'].llm_engine.config.model}, k={args.k}, {args.rounds} rounds alternated, "
          f"{args.max_tokens} max tokens, greedy; output tok/s (end-to-end), median over rounds")
    print(f"{'config':<12} {'batch':>5} {'tok/s':>9} {'vs none':>8} {'mean acc. len':>14}")
    for b in args.batch:
        base = statistics.median(rates[("none", b)])
        for n in names:
            med = statistics.median(rates[(n, b)])
            v, a = accept[(n, b)]
            mal = f"{1 + a / v:.2f}" if v else "-"
            print(f"{n:<12} {b:>5} {med:>9.1f} {med / base:>7.2f}x {mal:>14}")
    print(f"outputs differing from plain decoding: {mismatches}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
