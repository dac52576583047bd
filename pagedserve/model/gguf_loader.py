"""Load a llama.cpp GGUF file as a Hugging Face style checkpoint.

`load_gguf(path)` returns a `GGUFCheckpoint`: a `transformers.LlamaConfig`, a state dict of float32
tensors under Hugging Face parameter names and layout (so the engine builds its model exactly the way
it does from safetensors), and a `PreTrainedTokenizerFast` rebuilt from the vocabulary the file carries.

What differs between a GGUF and a Hugging Face Llama checkpoint, and is undone here:

* tensor names (`blk.3.attn_q.weight` instead of `model.layers.3.self_attn.q_proj.weight`);
* shape order: GGUF lists dimensions fastest-first (`ne[0]` is the row length), so the stored shape is
  the reverse of the PyTorch one;
* quantization: tensors are dequantized to float32 with `gguf.quants.dequantize`, or, with
  `keep_quantized`, 2-D weights in a block format pagedserve computes from (quant/gguf.py) stay as
  their raw blocks in `GGUFCheckpoint.quantized`;
* the q/k projections: llama.cpp's converter reorders the rows of each head so that its RoPE can rotate
  adjacent pairs (x0, x1), (x2, x3), ... while Hugging Face rotates the two halves of the head
  (x_i, x_{i+d/2}). `_unpermute_rows` puts them back;
* the tokenizer: a GGUF has no tokenizer.json, only the vocabulary, merges or SentencePiece scores and
  the special-token ids as metadata.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)

# Tensor types we dequantize. Anything else is refused with a clear error rather than guessed at.
_SUPPORTED_TYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# GGUF tensor name (inside a block) -> Hugging Face name (inside `model.layers.{i}.`).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp token types (tokenizer.ggml.token_type)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into a checkpoint (unsupported architecture, type, layout)."""


@dataclass
class GGUFCheckpoint:
    path: Path
    config: Any  # transformers.LlamaConfig
    state_dict: dict  # HF name -> float32 torch.Tensor in HF layout
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    metadata: dict = field(default_factory=dict)  # scalar GGUF metadata (no big arrays)
    tensor_types: dict = field(default_factory=dict)  # HF name -> GGML type name as stored ("Q4_1", ...)
    quantized: dict = field(default_factory=dict)  # keep_quantized: HF name -> (type name, uint8 tensor [rows, bytes])


# --------------------------------------------------------------------------------------------------
# locating the file


def _is_gguf_file(p: Path) -> bool:
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_gguf_path(path) -> Path | None:
    """The GGUF file `path` names, or None when it is not a GGUF model.

    `path` may be a `.gguf` file, or a directory holding exactly one `.gguf` and no `config.json` (a
    directory with a config.json is a Hugging Face checkpoint, even if a GGUF sits next to it).
    Several GGUFs in one directory are ambiguous: ValueError listing them.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return p if _is_gguf_file(p) else None
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() == ".gguf")
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(q.name for q in found)
        hint = ""
        if any(_SPLIT_RE.search(q.name) for q in found):
            hint = (" It looks like a split GGUF, which is not supported: merge it first with "
                    "`llama-gguf-split --merge FIRST_PART OUT.gguf`.")
        raise ValueError(f"{p} holds {len(found)} GGUF files ({names}); pass the path of the one to load.{hint}")
    return found[0]


# --------------------------------------------------------------------------------------------------
# metadata


def _field_value(fld) -> Any:
    return fld.contents()


def _read_metadata(reader, *, arrays: tuple[str, ...] = ()) -> dict:
    """Scalar metadata, plus the array fields named in `arrays` (the big tokenizer arrays are opt-in)."""
    import gguf

    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        is_array = bool(fld.types) and fld.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and name not in arrays:
            continue
        out[name] = _field_value(fld)
    return out


# --------------------------------------------------------------------------------------------------
# tensors


def _unpermute_rows(w, n_head: int):
    """Inverse of llama.cpp's q/k row reordering (for n_head heads of the rows of `w`).

    llama.cpp's converter views the rows of a head as (2, head_dim/2) -- the two rotary halves -- and
    transposes them to (head_dim/2, 2), interleaving the halves. Here we view them as (head_dim/2, 2)
    and transpose back. Works for weights (rows, cols) and biases (rows,).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot undo the q/k row order: {rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _dequantize(t) -> np.ndarray:
    """A GGUF reader tensor as a float32 numpy array in PyTorch (row-major, slowest-first) shape."""
    import gguf
    from gguf.quants import dequantize

    qtype = t.tensor_type
    if qtype.name not in _SUPPORTED_TYPE_NAMES:
        raise GGUFError(
            f"GGUF tensor '{t.name}' has type {qtype.name}, which pagedserve cannot load "
            f"(supported: {', '.join(_SUPPORTED_TYPE_NAMES)}). Re-quantize the model to one of these, "
            f"e.g. with llama.cpp's `llama-quantize IN.gguf OUT.gguf Q8_0`."
        )
    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    data = np.asarray(t.data)
    if qtype == gguf.GGMLQuantizationType.BF16 and data.dtype != np.uint8:
        data = data.view(np.uint8)
    arr = dequantize(data, qtype)
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    # F32 dequantization returns a view of the read-only memory map: copy so the map can be closed.
    return np.array(arr, dtype=np.float32, copy=True)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFError(
            "this GGUF carries 'rope_freqs.weight' (Llama-3.1 style RoPE frequency scaling), which "
            "pagedserve cannot load from GGUF yet; load the Hugging Face checkpoint instead"
        )
    raise GGUFError(f"unexpected tensor '{gguf_name}' in a llama GGUF (mixture-of-experts and other variants are not supported)")


# --------------------------------------------------------------------------------------------------
# config


def _valid_id(v, vocab_size: int) -> int | None:
    if v is None:
        return None
    v = int(v)
    return v if 0 <= v < vocab_size else None


def _build_config(md: dict, *, vocab_size: int, tied: bool, attention_bias: bool):
    from transformers import LlamaConfig

    a = "llama"

    def need(key):
        if f"{a}.{key}" not in md:
            raise GGUFError(f"GGUF metadata lacks '{a}.{key}'")
        return md[f"{a}.{key}"]

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(md.get(f"{a}.attention.head_count_kv", n_head))
    head_dim = int(md.get(f"{a}.attention.key_length", hidden // n_head))
    if int(md.get(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError("GGUF with different key and value head sizes is not supported")
    rot = md.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFError(f"partial rotary embeddings (rope.dimension_count={rot}, head_dim={head_dim}) are not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(md.get(f"{a}.rope.freq_base", 10000.0))}
    scaling = md.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = md.get(f"{a}.rope.scaling.factor")
        if scaling == "linear" and factor is not None:
            rope.update(rope_type="linear", factor=float(factor))
        else:
            raise GGUFError(f"GGUF RoPE scaling '{scaling}' is not supported (supported: none, linear)")
    eps = float(md.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5))

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(md.get(f"{a}.context_length", 2048)),
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
        bos_token_id=_valid_id(md.get("tokenizer.ggml.bos_token_id"), vocab_size),
        eos_token_id=_valid_id(md.get("tokenizer.ggml.eos_token_id"), vocab_size),
        pad_token_id=_valid_id(md.get("tokenizer.ggml.padding_token_id"), vocab_size),
        architectures=["LlamaForCausalLM"],
    )
    import inspect

    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers >= 5
        cfg = LlamaConfig(rope_parameters=rope, **kwargs)
    else:  # transformers 4.x
        legacy_scaling = None if rope["rope_type"] == "default" else {"rope_type": rope["rope_type"], "factor": rope["factor"]}
        cfg = LlamaConfig(rope_theta=rope["rope_theta"], rope_scaling=legacy_scaling, **kwargs)
    return cfg


# --------------------------------------------------------------------------------------------------
# tokenizer

# Pre-tokenizer split patterns for byte-level BPE vocabularies, keyed by llama.cpp's
# `tokenizer.ggml.pre`. These are the published patterns of the respective model families.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
# StarCoder-style vocabularies: every digit on its own, then GPT-2 splitting.
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell"}


def _spm_merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece-BPE vocabulary: a token that is the concatenation of two
    others is a merge, ranked by the token's score (higher scores merge first)."""
    ranked = []
    for idx, tok in enumerate(tokens):
        if len(tok) < 2 or (types and types[idx] not in (_TT_NORMAL, _TT_USER_DEFINED)):
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[idx]), idx, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _build_tokenizer(md: dict, context_length: int | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("this GGUF has no vocabulary (tokenizer.ggml.tokens); pass --tokenizer DIR")
    tokens = [str(t) for t in tokens]
    n = len(tokens)
    types = [int(x) for x in (md.get("tokenizer.ggml.token_type") or [])]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    def special(key):
        i = _valid_id(md.get(f"tokenizer.ggml.{key}"), n)
        return None if i is None else tokens[i]

    bos, eos, unk, pad = (special(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"))

    if kind == "llama":  # SentencePiece BPE with byte fallback
        scores = md.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError("SentencePiece GGUF vocabulary without scores (tokenizer.ggml.scores)")
        merges = _spm_merges(tokens, list(scores), types, vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
        add_bos_default = True
    elif kind == "gpt2":  # byte-level BPE
        merges_raw = md.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise GGUFError("byte-level BPE GGUF vocabulary without merges (tokenizer.ggml.merges)")
        merges = [tuple(str(m).split(" ", 1)) for m in merges_raw]
        pre = md.get("tokenizer.ggml.pre", "default")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE))
        if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
            pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRE else _QWEN2_PATTERN
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        elif pre in _DIGITS_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        else:  # "default", "gpt-2" and unknown: GPT-2's own splitting
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    else:
        raise GGUFError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: 'llama' SentencePiece, 'gpt2' byte-level BPE); "
            f"pass --tokenizer DIR with a Hugging Face tokenizer"
        )

    # Control tokens (and the unknown token) are special and never split; user-defined ones are kept whole.
    specials, added = [], []
    for i, t in enumerate(tokens):
        tt = types[i] if i < len(types) else _TT_NORMAL
        if tt in (_TT_CONTROL, _TT_UNKNOWN) or t in (bos, eos, unk, pad):
            specials.append(AddedToken(t, special=True, normalized=False))
        elif tt == _TT_USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    if specials:
        tok.add_special_tokens(specials)
    if added:
        tok.add_tokens(added)

    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        # Template keys are placeholders, so token spellings with ':' or spaces cannot confuse the syntax.
        b, e = (["BOS"] if add_bos else []), (["EOS"] if add_eos else [])
        specials_map = []
        if add_bos:
            specials_map.append({"id": "BOS", "ids": [vocab[bos]], "tokens": [bos]})
        if add_eos:
            specials_map.append({"id": "EOS", "ids": [vocab[eos]], "tokens": [eos]})
        template = processors.TemplateProcessing(
            single=b + ["$A"] + e,
            pair=b + ["$A"] + e + [x + ":1" for x in b] + ["$B:1"] + [x + ":1" for x in e],
            special_tokens=specials_map,
        )
        if kind == "gpt2":
            tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
        else:
            tok.post_processor = template
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    kwargs: dict[str, Any] = {k: v for k, v in dict(bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad).items() if v is not None}
    chat_template = md.get("tokenizer.chat_template")
    if chat_template:
        kwargs["chat_template"] = str(chat_template)
    if context_length:
        kwargs["model_max_length"] = int(context_length)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    return fast


# --------------------------------------------------------------------------------------------------
# entry point


def _raw_blocks(t) -> np.ndarray:
    """A block-quantized tensor's bytes as uint8 [rows, bytes per row] (a copy: the map is closed later)."""
    data = np.asarray(t.data)
    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    return np.array(data.reshape(rows, -1), dtype=np.uint8, copy=True)


def load_gguf(path, tokenizer_dir=None, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read a llama GGUF (a file, or a directory holding exactly one) into config, state dict, tokenizer.
    keep_quantized: 2-D weights in a block format of quant.gguf.KEPT_TYPES go to `quantized` as
    their raw blocks instead of the state dict."""
    import gguf
    import torch

    p = resolve_gguf_path(path)
    if p is None:
        raise FileNotFoundError(f"no GGUF file at {path}")
    reader = gguf.GGUFReader(str(p), "r")
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    tok_arrays = () if tokenizer_dir else (
        "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"
    )
    md = _read_metadata(reader, arrays=tok_arrays)
    n_head = int(md.get("llama.attention.head_count", 0))
    n_kv = int(md.get("llama.attention.head_count_kv", n_head))
    if n_head <= 0 or n_kv <= 0:
        raise GGUFError(f"{p}: GGUF metadata lacks a valid llama.attention.head_count / head_count_kv")

    from pagedserve.quant.gguf import KEPT_TYPES

    state_dict: dict[str, torch.Tensor] = {}
    tensor_types: dict[str, str] = {}
    quantized: dict[str, tuple[str, torch.Tensor]] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if keep_quantized and t.tensor_type.name in KEPT_TYPES and len(t.shape) == 2:
            raw = torch.from_numpy(_raw_blocks(t))
            if name.endswith("self_attn.q_proj.weight"):
                raw = _unpermute_rows(raw, n_head)
            elif name.endswith("self_attn.k_proj.weight"):
                raw = _unpermute_rows(raw, n_kv)
            quantized[name] = (t.tensor_type.name, raw)
            tensor_types[name] = t.tensor_type.name
            continue
        arr = torch.from_numpy(_dequantize(t))
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            arr = _unpermute_rows(arr, n_head)
        elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            arr = _unpermute_rows(arr, n_kv)
        state_dict[name] = arr
        tensor_types[name] = t.tensor_type.name
    del reader

    emb_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    if emb_name not in state_dict and emb_name not in quantized:
        raise GGUFError(f"{p} has no token_embd.weight")
    emb = state_dict.get(emb_name)
    vocab_size = int(emb.shape[0] if emb is not None else quantized[emb_name][1].shape[0])
    # Tied when there is no separate output matrix, or when the file repeats the embedding verbatim
    # (llama2.c exports do): one fewer matrix in memory and the same model.
    if head_name in quantized or emb_name in quantized:
        a, b = quantized.get(head_name), quantized.get(emb_name)
        has_head = head_name in quantized or head_name in state_dict
        tied = not has_head or (a is not None and b is not None and a[0] == b[0] and torch.equal(a[1], b[1]))
    else:
        head = state_dict.get(head_name)
        has_head = head is not None
        tied = head is None or (head.shape == emb.shape and torch.equal(head, emb))
    if tied and has_head:
        state_dict.pop(head_name, None)
        quantized.pop(head_name, None)
        tensor_types.pop(head_name, None)
    attention_bias = any(k.endswith("self_attn.q_proj.bias") for k in state_dict)
    config = _build_config(md, vocab_size=vocab_size, tied=tied, attention_bias=attention_bias)

    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:
        tokenizer = _build_tokenizer(md, config.max_position_embeddings)

    scalar_md = {k: v for k, v in md.items() if k not in tok_arrays}
    return GGUFCheckpoint(path=p, config=config, state_dict=state_dict, tokenizer=tokenizer,
                          metadata=scalar_md, tensor_types=tensor_types, quantized=quantized)
