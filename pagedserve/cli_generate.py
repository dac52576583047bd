"""`pagedserve generate`: one prompt (or chat message) in, the completion printed."""
from __future__ import annotations

import sys


def register(sub) -> None:
    from pagedserve.engine.args import add_engine_args

    p = sub.add_parser("generate", help="generate a completion for a prompt and print it")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system prompt (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import logging

    from pagedserve.engine.args import config_from_args
    from pagedserve.errors import ConfigError, InvalidRequestError
    from pagedserve.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        from pagedserve.llm import LLM

        llm = LLM.from_config(config_from_args(args))
        sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed)
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
            out = llm.chat(msgs, sp)[0]
        else:
            out = llm.generate(args.prompt, sp)[0]
    except (ConfigError, InvalidRequestError, RuntimeError) as e:
        print(f"pagedserve generate: error: {e}", file=sys.stderr)
        return 2
    for o in out.outputs:
        if len(out.outputs) > 1:
            print(f"--- sample {o.index} ({o.finish_reason})")
        print(o.text)
    return 0
