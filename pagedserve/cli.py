"""`pagedserve` command line: one sub-command per module, each registering its own arguments.

Sub-command modules expose `register(subparsers)`; the parser they add carries `func=run(args)`.
Modules are imported lazily per command so `pagedserve plan` never imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (command name, module that registers it)
_COMMANDS = [
    ("serve", "pagedserve.server.cli"),
    ("generate", "pagedserve.cli_generate"),
    ("chat", "pagedserve.cli_chat"),
    ("bench", "pagedserve.bench.cli"),
    ("plan", "pagedserve.plan"),
    ("eval", "pagedserve.eval.cli"),
    ("doctor", "pagedserve.doctor.cli"),
]


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option whose help does not already say its default; options
    without a value (flags) or whose default is None (meaning "decided later": their help says how)
    are left as they are."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings or action.nargs == 0):
            return text
        return text + " (default: %(default)s)"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Gives every parser under `parser` (sub-commands at any depth) the defaults-showing formatter:
    one place, so that a command added later shows its defaults too."""
    parser.formatter_class = _DefaultsHelpFormatter
    for action in parser._actions:
        if (action.help is None and action.option_strings and action.nargs != 0
                and action.default not in (None, False, argparse.SUPPRESS)):
            action.help = "(default: %(default)s)"  # argparse prints nothing for an option without help
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _COMMANDS:
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("pagedserve"):
                continue  # command not built yet in this checkout
            raise
        mod.register(sub)
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pagedserve.config import set_openmp_wait_default

    set_openmp_wait_default()  # before any command imports torch
    first = next((a for a in argv if not a.startswith("-")), None)
    known = {n for n, _ in _COMMANDS}
    parser = build_parser(only=first if first in known else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
