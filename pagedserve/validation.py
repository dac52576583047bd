"""Request validation: the one place that decides whether a request can be served as given.

Every entry point goes through here. `LLMEngine.add_request` (the Python API `LLM`, and the HTTP
server through the AsyncEngine) runs `RequestValidator.validate`; the server only adds what must
happen before it tokenizes (`check_prompt_text`) and maps the InvalidRequestError raised here to an
OpenAI-style HTTP 400.

What is checked, and why:
* every number against what the sampler's tensors can hold: integers must fit int64 (torch turns
  a larger Python int into an "Overflow when unpacking long long" inside the engine step, which
  would fail the whole batch), floats must be finite and fit float32 (the sampler's dtype);
* every number against its meaning (top_p in (0, 1], penalties in vLLM's ranges, ...);
* the cost one request may impose: n, logprobs, stop strings and stop token ids are capped, and a
  text prompt that cannot fit the context is refused before the whole text is tokenized.

A top_k at or above the vocabulary size means "off" and is normalised to 0 here, so the sampler
never sees a number larger than the vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_SAMPLING_INTS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; each bound keeps one request's cost proportionate."""

    max_n: int = 128  # parallel samples of one prompt
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logits_token_ids: int = 1 << 17  # logit_bias / allowed_token_ids entries (a whole vocabulary fits)
    max_prompts_per_request: int = 1024  # /v1/completions takes a list of prompts
    # A token covers at most this many times its own length in characters (Unicode normalisation
    # can fold several characters into one before the tokenizer sees them).
    chars_per_token_char: int = 4


DEFAULT_LIMITS = RequestLimits()


def _bad(msg: str, param: str):
    raise InvalidRequestError(msg, param)


def _check_int(name: str, v, *, lo: int = INT64_MIN, hi: int = INT64_MAX, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        _bad(f"{name} must be an integer, got {v!r}.", name)
    if not (INT64_MIN <= v <= INT64_MAX):
        _bad(f"{name} must fit in a signed 64-bit integer, got {v}.", name)
    if not (lo <= v <= hi):
        _bad(f"{name} must be between {lo} and {hi}, got {v}.", name)


def check_sampling_params(params, max_logprobs: int = 20, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """The checks that need no model: types, int64/float32 limits, ranges, per-request caps."""
    p = params
    for name in _SAMPLING_FLOATS:
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            _bad(f"{name} must be a number, got {v!r}.", name)
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            _bad(f"{name} must be a finite 32-bit float, got {v!r}.", name)
    for name in _SAMPLING_INTS:
        _check_int(name, getattr(p, name), allow_none=name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"))
    if not (1 <= p.n <= limits.max_n):
        _bad(f"n must be between 1 and {limits.max_n}, got {p.n}.", "n")
    if p.temperature < 0:
        _bad(f"temperature must be non-negative, got {p.temperature}.", "temperature")
    if not (0.0 < p.top_p <= 1.0):
        _bad(f"top_p must be in (0, 1], got {p.top_p}.", "top_p")
    if p.top_k < -1:
        _bad(f"top_k must be -1 or 0 (off) or a positive integer, got {p.top_k}.", "top_k")
    if not (0.0 <= p.min_p <= 1.0):
        _bad(f"min_p must be in [0, 1], got {p.min_p}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not (-2.0 <= getattr(p, name) <= 2.0):
            _bad(f"{name} must be in [-2, 2], got {getattr(p, name)}.", name)
    if not (0.0 < p.repetition_penalty <= 2.0):
        _bad(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}.", "repetition_penalty")
    if p.max_tokens is not None and p.max_tokens < 1:
        _bad(f"max_tokens must be at least 1, got {p.max_tokens}.", "max_tokens")
    if p.min_tokens < 0:
        _bad(f"min_tokens must be non-negative, got {p.min_tokens}.", "min_tokens")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _bad(f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens}).", "min_tokens")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and not (0 <= v <= max_logprobs):
            _bad(f"{name} must be between 0 and {max_logprobs} (--max-logprobs), got {v}.", name)
    stop = p.stop or []
    if len(stop) > limits.max_stop_strings:
        _bad(f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stop)}.", "stop")
    for s in stop:
        if not isinstance(s, str) or not s:
            _bad("stop strings must be non-empty strings.", "stop")
        if len(s) > limits.max_stop_string_chars:
            _bad(f"a stop string may have at most {limits.max_stop_string_chars} characters, got {len(s)}.", "stop")
    if len(p.stop_token_ids or ()) > limits.max_stop_token_ids:
        _bad(f"at most {limits.max_stop_token_ids} stop_token_ids are allowed, got {len(p.stop_token_ids)}.",
             "stop_token_ids")
    for v in (p.logit_bias or {}).values():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            _bad(f"logit_bias values must be finite 32-bit floats, got {v!r}.", "logit_bias")
    if len(p.logit_bias or ()) > limits.max_logits_token_ids:
        _bad(f"logit_bias may name at most {limits.max_logits_token_ids} tokens.", "logit_bias")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        _bad("allowed_token_ids must not be empty.", "allowed_token_ids")
    if len(p.allowed_token_ids or ()) > limits.max_logits_token_ids:
        _bad(f"allowed_token_ids may name at most {limits.max_logits_token_ids} tokens.", "allowed_token_ids")
    words = p.bad_words or []
    if len(words) > limits.max_stop_strings:
        _bad(f"at most {limits.max_stop_strings} bad_words are allowed, got {len(words)}.", "bad_words")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > limits.max_stop_string_chars:
            _bad(f"bad_words must be non-blank strings of at most {limits.max_stop_string_chars} characters.",
                 "bad_words")


def check_token_ids(ids, vocab_size: int, param: str = "prompt") -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab_size):
            _bad(f"Token id {t!r} is out of vocabulary range [0, {vocab_size}).", param)


def longest_token_chars(tokenizer) -> int:
    """Characters the longest vocabulary entry spells (raw entries are at least as long as the text
    they stand for: byte-level BPE spells one byte per character, SentencePiece one per character)."""
    try:
        vocab = tokenizer.get_vocab()
        return max((len(t) for t in vocab), default=1) or 1
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no text bound beyond the body cap
        return 0


@dataclass
class ValidatedRequest:
    prompt_token_ids: list[int]
    stop_token_ids: frozenset  # the request's stop ids, plus EOS unless ignore_eos


class RequestValidator:
    """Checks one request against the model it will run on (vocabulary, context, EOS ids)."""

    def __init__(self, *, max_model_len: int, vocab_size: int, max_logprobs: int = 20, eos_ids=(),
                 max_token_chars: int = 0, limits: RequestLimits = DEFAULT_LIMITS, max_input_tokens: int | None = None):
        self.max_model_len = max_model_len
        self.max_input_tokens = max_input_tokens
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.eos_ids = frozenset(eos_ids)
        self.limits = limits
        # 0: unknown (no text bound beyond the body cap)
        self.max_prompt_chars = max_model_len * max_token_chars * limits.chars_per_token_char

    @classmethod
    def for_engine(cls, config, vocab_size: int, tokenizer, eos_ids=()) -> "RequestValidator":
        return cls(max_model_len=config.max_model_len, vocab_size=vocab_size, max_logprobs=config.max_logprobs,
                   eos_ids=eos_ids, max_token_chars=longest_token_chars(tokenizer),
                   max_input_tokens=getattr(config, "max_input_tokens", None))

    # -- before tokenizing --------------------------------------------------------------------
    def check_prompt_text(self, text, param: str = "prompt", allow_empty: bool = False) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens."""
        if not isinstance(text, str):
            _bad("prompt must be a string or a list of token ids.", param)
        if not text and not allow_empty:
            _bad("The prompt must not be empty.", param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON "\ud800" escape: no tokenizer takes it
            _bad(f"The prompt is not valid Unicode text ({e.reason} at character {e.start}).", param)
        if self.max_prompt_chars and len(text) > self.max_prompt_chars:
            _bad(f"The prompt has {len(text)} characters; this model's maximum context length of "
                 f"{self.max_model_len} tokens cannot hold more than {self.max_prompt_chars} characters. "
                 "Please shorten the prompt.", param)

    def check_truncate_prompt_tokens(self, k) -> None:
        """truncate_prompt_tokens: -1 (keep max_model_len tokens) or 1..max_model_len."""
        if k is None:
            return
        _check_int("truncate_prompt_tokens", k)
        if k != -1 and not (1 <= k <= self.max_model_len):
            _bad(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len ({self.max_model_len}), "
                 f"got {k}.", "truncate_prompt_tokens")

    def check_num_prompts(self, n: int, param: str = "prompt") -> None:
        if n > self.limits.max_prompts_per_request:
            _bad(f"at most {self.limits.max_prompts_per_request} prompts are allowed in one request, got {n}.", param)

    # -- the whole request ----------------------------------------------------------------------
    def validate(self, prompt_token_ids, params) -> ValidatedRequest:
        """Check token ids and params; fills params.max_tokens when None (the rest of the context,
        as vLLM does) and turns a top_k at or above the vocabulary into 0 (off)."""
        check_sampling_params(params, self.max_logprobs, self.limits)
        ids = list(prompt_token_ids)
        if not ids:
            _bad("The prompt must not be empty.", "prompt")
        L = self.max_model_len
        n_prompt = len(ids)
        if n_prompt >= L:
            _bad(f"This model's maximum context length is {L} tokens, but the prompt has {n_prompt} tokens. "
                 "Please shorten the prompt.", "prompt")
        if self.max_input_tokens is not None and n_prompt > self.max_input_tokens:
            _bad(f"The prompt has {n_prompt} tokens, more than this server accepts "
                 f"(--max-input-tokens {self.max_input_tokens}). Please shorten the prompt.", "prompt")
        check_token_ids(ids, self.vocab_size, "prompt")
        check_token_ids(params.stop_token_ids or (), self.vocab_size, "stop_token_ids")
        check_token_ids(params.logit_bias or (), self.vocab_size, "logit_bias")
        check_token_ids(params.allowed_token_ids or (), self.vocab_size, "allowed_token_ids")
        if params.max_tokens is None:
            params.max_tokens = L - n_prompt
        if n_prompt + params.max_tokens > L:
            _bad(f"This model's maximum context length is {L} tokens. However, you requested "
                 f"{n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, {params.max_tokens} in the "
                 "completion). Please reduce the length of the prompt or max_tokens.", "max_tokens")
        if params.min_tokens > params.max_tokens:
            _bad(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens}).", "min_tokens")
        if params.top_k < 0 or params.top_k >= self.vocab_size:
            params.top_k = 0
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        return ValidatedRequest(ids, frozenset(stop_ids))
