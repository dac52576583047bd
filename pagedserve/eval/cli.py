"""`pagedserve eval`: quality checks of the engine's model. `eval perplexity --model M --text FILE`."""
from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    from pagedserve.engine.args import add_engine_args

    ev = subparsers.add_parser("eval", help="evaluate the model: perplexity over a text file")
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])
    sub = ev.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND")
    p = sub.add_parser(
        "perplexity", help="perplexity of the model over a text file",
        description="Tokenize the whole file, cut it into windows of --window tokens every --stride tokens, run "
        "each window through pagedserve's model (prompt logprobs) and report exp(mean NLL). In each window, "
        "positions 1..len-1 are scored given the window's tokens before them (with stride < window, only "
        "tokens past the previous window's end), so every token is scored at most once.")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default: 512, or max-model-len - 1 if smaller)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: the window)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_engine_args(p)
    p.set_defaults(func=run_perplexity)


def run_perplexity(args) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from pagedserve.engine.args import config_from_args
    from pagedserve.errors import ConfigError, InvalidRequestError

    def fail(msg) -> int:
        print(f"pagedserve eval perplexity: error: {msg}", file=sys.stderr)
        return 2

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return fail(f"cannot read --text {args.text}: {e}")
    if not text.strip():
        return fail(f"--text {args.text} is empty")
    if args.window is not None and args.window < 2:
        return fail(f"--window must be at least 2, got {args.window}")
    if args.stride is not None and args.stride < 1:
        return fail(f"--stride must be at least 1, got {args.stride}")
    try:
        config = config_from_args(args)
        from pagedserve.eval.perplexity import evaluate
        from pagedserve.llm import LLM

        llm = LLM.from_config(config)
        res = evaluate(llm, text, window=args.window, stride=args.stride)
    except (ConfigError, InvalidRequestError, ValueError, RuntimeError) as e:
        return fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    print(json.dumps(res.to_dict()) if args.json else res.line())
    return 0
