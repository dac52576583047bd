"""Default sampling parameters a model asks for (vLLM's `--generation-config auto|vllm|DIR`).

A request's own values always win; these fill only the fields a request leaves out. `auto` reads the
model folder's generation_config.json (Hugging Face's keys: temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens), `vllm` uses none (temperature 1.0, everything off, as vLLM's own
defaults), and a folder reads that folder's generation_config.json. The embedded default model (a
GGUF, with no generation_config.json) gets the settings its authors recommend for it."""
from __future__ import annotations

import json
from pathlib import Path

from pagedserve.errors import ConfigError

# Hugging Face generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

# SmolLM2-135M-Instruct's model card samples with temperature 0.2 and top_p 0.9. max_tokens is ours:
# at temperature 1.0 with no limit a chat with this small model ran on to the 8k context.
EMBEDDED_MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 1024}


def _read(folder: Path) -> dict:
    f = folder / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {f}: {e} (--generation-config)") from None
    out = {}
    for hf_key, field in _KEYS.items():
        v = raw.get(hf_key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[field] = int(v) if field in ("top_k", "max_tokens") else float(v)
    return out


def check_setting(setting: str) -> None:
    if setting not in ("auto", "vllm") and not Path(setting).expanduser().is_dir():
        raise ConfigError(f"--generation-config {setting!r}: use auto, vllm, or a folder holding generation_config.json")


def generation_defaults(setting: str, model: str | None) -> tuple[dict, str]:
    """(SamplingParams field -> default, where they came from) for `--generation-config setting`."""
    check_setting(setting)
    if setting == "vllm":
        return {}, "--generation-config vllm"
    if setting != "auto":
        folder = Path(setting).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config {setting}: no generation_config.json in that folder")
        return _read(folder), str(folder / "generation_config.json")
    if model is None:
        return dict(EMBEDDED_MODEL_DEFAULTS), "the embedded default model's recommended settings"
    p = Path(model).expanduser()
    folder = p if p.is_dir() else p.parent if p.is_file() else None
    if folder is None:  # a hub name: its generation_config.json in the local hub cache, if any
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "generation_config.json")
        except Exception:  # noqa: BLE001 - no cache, bad name: no defaults
            found = None
        folder = Path(found).parent if isinstance(found, str) else None
    if folder is None or not (folder / "generation_config.json").is_file():
        return {}, "none (the model has no generation_config.json)"
    return _read(folder), str(folder / "generation_config.json")


def describe(defaults: dict, source: str) -> str:
    """The start-up log line."""
    if not defaults:
        return f"default sampling parameters: vLLM's (temperature 1.0, no top-p/top-k); from {source}"
    items = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return f"default sampling parameters: {items} (from {source}); a request's own values win"
