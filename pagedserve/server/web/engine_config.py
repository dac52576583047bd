"""What the page's configuration panel shows: the flags in effect and what the engine resolved.

Secrets never leave the server: the API key is reported only as set / not set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

SECRET_FLAGS = ("api_key",)


def _plain(value):
    """A JSON-safe copy (paths, dtypes and other objects become their str)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_plain(v) for v in value]
        return str(value)


def _flag_defaults() -> dict:
    """Every `pagedserve serve` flag's default, to mark the flags a user changed."""
    from pagedserve.engine.args import add_engine_args
    from pagedserve.server.cli import add_server_args

    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    add_engine_args(parser)
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}


def flags_in_effect(args: argparse.Namespace) -> list[dict]:
    """[{flag, value, default, changed}] for each serve flag, in the parser's order."""
    try:
        defaults = _flag_defaults()
    except Exception:  # noqa: BLE001 - a parser that cannot be rebuilt still leaves the values
        defaults = {}
    given = vars(args)
    rows = []
    for dest in list(defaults) + [k for k in given if k not in defaults]:
        if dest in ("func", "model_tag", "command") or dest.startswith("_"):
            continue
        value = given.get(dest, defaults.get(dest))
        default = defaults.get(dest)
        if dest in SECRET_FLAGS:
            value = "(set)" if value else None
            default = None
        rows.append({"flag": "--" + dest.replace("_", "-"), "value": _plain(value), "default": _plain(default),
                     "changed": dest in defaults and value != default})
    return rows


def engine_configuration(async_engine, args: argparse.Namespace, served_model_names: list[str],
                         version: str, kv_blocks: float | None, api_key_required: bool) -> dict:
    cfg = async_engine.config
    engine = getattr(async_engine, "engine", None)
    dtype = getattr(engine, "dtype", None)
    resolved = {k: _plain(v) for k, v in dataclasses.asdict(cfg).items() if k != "extra"}
    num_blocks = int(kv_blocks) if kv_blocks else None
    return {
        "version": version,
        "model": str(cfg.model),
        "served_model_names": list(served_model_names),
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else cfg.dtype,
        "device": str(getattr(engine, "device", cfg.device)),
        "max_model_len": cfg.max_model_len,
        "kv_cache": {
            "num_blocks": num_blocks,
            "block_size": cfg.block_size,
            "num_tokens": num_blocks * cfg.block_size if num_blocks else None,
            "prefix_caching": cfg.enable_prefix_caching,
        },
        "engine": resolved,
        "flags": flags_in_effect(args),
        "api_key_required": api_key_required,
    }
