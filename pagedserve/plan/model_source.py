"""Where `pagedserve plan` finds a model's shape: a folder or config.json, a GGUF file's metadata,
the Hugging Face hub cache, or the table of popular checkpoints shipped with the package. Only
shape numbers are read, never weights, and nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path

from pagedserve.plan.inputs import PlanError

# Suffixes of chat / instruct variants that share their base checkpoint's shape.
_VARIANT_SUFFIXES = ("-instruct", "-chat-hf", "-chat", "-hf", "-it", "-4k-instruct")


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def popular_models() -> dict:
    path = Path(__file__).parent.parent / "data" / "model_configs.json"
    with open(path) as f:
        return json.load(f)["models"]


def _from_table(name: str) -> tuple[str, dict] | None:
    table = popular_models()
    by_full = {_norm(k): k for k in table}
    by_short = {_norm(k.split("/")[-1]): k for k in table}
    short = name.split("/")[-1]
    candidates = [short] + [short[: -len(s)] for s in _VARIANT_SUFFIXES if short.lower().endswith(s)]
    for c in [name, *candidates]:
        key = by_full.get(_norm(c)) or by_short.get(_norm(c))
        if key is not None:
            cfg = dict(table[key])
            note = cfg.pop("_note", None)
            return f"{key} (built-in table of popular configs{'; ' + note if note else ''})", cfg
    return None


def _from_hub_cache(name: str) -> tuple[str, dict] | None:
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "config.json")
    if isinstance(found, str) and Path(found).is_file():
        with open(found) as f:
            return found, json.load(f)
    return None


def _from_gguf(path: Path) -> tuple[str, dict]:
    """A config dict like a Hugging Face config.json, from a GGUF file's metadata (no tensor is read)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the gguf reader raises ValueError, struct.error, ... on a damaged file
        raise PlanError(f"cannot read GGUF {path}: {e}") from None
    fields = {name: fld for name, fld in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None

    def meta(key, default=None):
        fld = fields.get(f"{arch}.{key}")
        return fld.contents() if fld is not None else default

    tensors = {t.name: t for t in reader.tensors}
    if arch is None or meta("embedding_length") is None or "token_embd.weight" not in tensors:
        raise PlanError(f"{path}: GGUF metadata lacks the architecture's shape (general.architecture={arch!r})")
    n_head = int(meta("attention.head_count"))
    cfg = {
        "model_type": "llama" if arch == "llama" else str(arch),
        "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_head)),
        "intermediate_size": int(meta("feed_forward_length")),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if meta("attention.key_length") is not None:
        cfg["head_dim"] = int(meta("attention.key_length"))
    # The weights' storage: the type most of the parameters are stored in.
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    main_type = max(counts, key=counts.get)
    if main_type in ("F16", "BF16", "F32"):
        cfg["torch_dtype"] = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[main_type]
    elif main_type.startswith(("Q4", "Q5", "Q6", "Q3", "Q2", "IQ")):
        cfg["quantization_config"] = {"quant_method": "gguf", "bits": 4, "gguf_type": main_type}
    elif main_type.startswith("Q8"):
        cfg["quantization_config"] = {"quant_method": "gguf", "bits": 8, "gguf_type": main_type}
    return f"{path} (GGUF metadata, weights mostly {main_type})", cfg


def load_model_config(model: str) -> tuple[str, dict]:
    """(where the shape came from, a config.json-like dict) for `plan --model`."""
    p = Path(model).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
    if p.is_file():
        with open(p, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        if is_gguf:
            return _from_gguf(p)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            with open(p) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read {p}: {e}") from None
        if not isinstance(cfg, dict):
            raise PlanError(f"{p} is not a JSON object")
        return str(p), cfg
    for source in (_from_hub_cache, _from_table):
        found = source(model)
        if found is not None:
            return found
    known = ", ".join(sorted(k.split("/")[-1] for k in popular_models()))
    raise PlanError(f"--model {model!r}: not a model folder, config.json or GGUF file, not in the hub cache, and not a "
                    f"built-in config (known names: {known})")
