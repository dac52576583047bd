"""Request sets for `pagedserve bench serve`.

A generic OpenAI-compatible client does not know the server's tokenizer, so:

* for `/v1/completions` random prompts are lists of token ids (the OpenAI API accepts a token-id
  list as `prompt`) drawn uniformly from [3, vocab_size) with `numpy.random.default_rng(seed)`;
  the prompt length is then exact;
* for `/v1/chat/completions` (text only) prompts are random words, about one token per word on
  common BPE vocabularies; the real count comes back in the server's `usage`.

Every count the report uses comes from the server's `usage`; the lengths here are the targets.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# First token id drawn for random prompts: ids 0-2 are <unk>/<s>/</s> on Llama-style vocabularies.
MIN_TOKEN_ID = 3

# Common short English words: on BPE vocabularies most are one token with their leading space.
_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which be this has "
    "had not but also first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "north south east west high part both three year well game team life home work water name "
    "house road river music film book light day night small large early late long short great "
    "good best last next each under between through while since than before around because "
    "place point form line side case group number people place power story system word world"
).split()


@dataclass
class SampleRequest:
    """One request to send: `prompt` is text or a list of token ids."""

    prompt: str | list[int]
    prompt_len: int  # target (exact for token-id prompts)
    output_len: int  # max_tokens asked for


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n integer lengths uniform in [length*(1-r), length*(1+r)] (both ends included), at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    lo = max(1, math.floor(length * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(length * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    return rng.integers(MIN_TOKEN_ID, vocab_size, size=n).tolist()


def random_text(rng: np.random.Generator, n_words: int) -> str:
    idx = rng.integers(0, len(_WORDS), size=n_words)
    return " ".join(_WORDS[i] for i in idx)


def _make_prompt(rng: np.random.Generator, n: int, as_text: bool, vocab_size: int) -> str | list[int]:
    return random_text(rng, n) if as_text else random_token_ids(rng, n, vocab_size)


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    vocab_size: int = 256,
    as_text: bool = False,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` independent random prompts."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    return [
        SampleRequest(_make_prompt(rng, int(i), as_text, vocab_size), int(i), int(o))
        for i, o in zip(in_lens, out_lens)
    ]


def shared_prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    *,
    num_groups: int = 1,
    range_ratio: float = 0.0,
    vocab_size: int = 256,
    as_text: bool = False,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts = one of `num_groups` fixed prefixes (`prefix_len` tokens) + a random suffix.

    Prompt i uses prefix i % num_groups, so prefix caching can reuse it. Suffix and output lengths
    follow `range_ratio` like the random set; the prefix length is exact.
    """
    if num_groups < 1:
        raise ValueError("--shared-prefix-num-groups must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_make_prompt(rng, prefix_len, as_text, vocab_size) for _ in range(num_groups)]
    suf_lens = sample_lengths(rng, num_prompts, suffix_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for i, (s, o) in enumerate(zip(suf_lens, out_lens)):
        prefix = prefixes[i % num_groups]
        suffix = _make_prompt(rng, int(s), as_text, vocab_size)
        prompt = (prefix + " " + suffix) if as_text else (prefix + suffix)
        out.append(SampleRequest(prompt, prefix_len + int(s), int(o)))
    return out


def jsonl_dataset(path: str | Path, num_prompts: int, default_output_len: int) -> list[SampleRequest]:
    """Read `{"prompt": str | [ids], "output_len": int?}` lines; cycle if there are fewer than asked.

    `prompt_len` is the id count for token-id prompts and the word count (an estimate) for text.
    """
    items: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}:{lineno}: each line needs a \"prompt\" field")
            prompt = obj["prompt"]
            if isinstance(prompt, list):
                if not all(isinstance(t, int) for t in prompt):
                    raise ValueError(f"{path}:{lineno}: a list prompt must hold token ids (ints)")
                plen = len(prompt)
            elif isinstance(prompt, str):
                plen = len(prompt.split())
            else:
                raise ValueError(f"{path}:{lineno}: \"prompt\" must be a string or a list of ints")
            olen = obj.get("output_len", default_output_len)
            if not isinstance(olen, int) or olen < 1:
                raise ValueError(f"{path}:{lineno}: \"output_len\" must be a positive integer")
            items.append(SampleRequest(prompt, plen, olen))
            if len(items) >= num_prompts:
                break
    if not items:
        raise ValueError(f"{path}: no prompts")
    return [items[i % len(items)] for i in range(num_prompts)]
