"""SpeculativeConfig: what `--speculative-config` (vLLM's JSON keys) asks for, checked at start.

Methods:
- "ngram": prompt lookup. The last n tokens (prompt_lookup_max down to prompt_lookup_min) are
  searched for earlier in the sequence; the tokens that followed that occurrence are the draft.
- "suffix": suffix decoding. A suffix tree over this request's tokens and the outputs of earlier
  requests of this server proposes the continuation seen most often after the current suffix.
- "draft_model": a smaller model with the same tokenizer drafts greedily from its own paged KV cache.

Every method drafts deterministically, so the verifier's rejection rule uses a one-hot draft
distribution (accept a drafted token x with probability p(x); on rejection resample from p with x
removed), which keeps every output exactly the target's distribution.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pagedserve.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")
_ALIASES = {"[ngram]": "ngram", "ngram": "ngram", "suffix": "suffix", "draft_model": "draft_model",
            "draft": "draft_model"}
_KEYS = {
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size", "acceptance_disable_threshold", "acceptance_window",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_min_token_prob",
}


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: HF folder or GGUF of the draft
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: shortest suffix looked up
    disable_by_batch_size: int | None = None  # no speculation while this many sequences or more run
    # A sequence stops speculating once its acceptance rate over its last `acceptance_window`
    # drafted tokens is below this threshold (0 disables the check).
    acceptance_disable_threshold: float = 0.0
    acceptance_window: int = 32
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """value: None, a SpeculativeConfig, a dict or a JSON string (the --speculative-config flag)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON ({e.msg}); "
                                  """e.g. '{"method": "ngram", "num_speculative_tokens": 4}'""") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                              f"known keys: {', '.join(sorted(_KEYS))}")
        d = dict(value)
        method = d.pop("method", None)
        if method is None:  # vLLM infers it: a model path means a draft model, "[ngram]" prompt lookup
            model = d.get("model")
            method = "ngram" if model in (None, "[ngram]", "ngram") else "draft_model"
        if method not in _ALIASES:
            raise ConfigError(f"--speculative-config: unknown method {method!r}; use one of {', '.join(METHODS)}")
        method = _ALIASES[method]
        if method != "draft_model" and d.get("model") in ("[ngram]", "ngram"):
            d.pop("model")
        if "num_speculative_tokens" not in d:
            if method != "suffix":
                raise ConfigError("--speculative-config: num_speculative_tokens is required (e.g. 4)")
            d["num_speculative_tokens"] = d.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth)
        cfg = cls(method=method, **d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(msg):
            raise ConfigError(f"--speculative-config: {msg}")

        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            bad(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "draft_model" and not self.model:
            bad('method "draft_model" needs "model": the draft model\'s folder or GGUF file')
        if self.method != "draft_model" and self.model:
            bad(f'"model" is only used by method "draft_model", not {self.method!r}')
        if self.method == "ngram":
            if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
                bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                    f"{self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            bad("disable_by_batch_size must be >= 1")
        if not (0.0 <= self.acceptance_disable_threshold <= 1.0):
            bad(f"acceptance_disable_threshold must be in [0, 1], got {self.acceptance_disable_threshold}")
        if self.acceptance_window < 1:
            bad("acceptance_window must be >= 1")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            bad("suffix_decoding_max_tree_depth must be >= 1 and suffix_decoding_max_cached_requests >= 0")
        if not (0.0 <= self.suffix_decoding_min_token_prob <= 1.0):
            bad("suffix_decoding_min_token_prob must be in [0, 1]")


def from_legacy_flags(speculative_model: str | None, num_speculative_tokens: int | None) -> dict | None:
    """The older `--speculative-model DIR|[ngram]` and `--num-speculative-tokens K` flags as a config dict."""
    if speculative_model is None and num_speculative_tokens is None:
        return None
    if speculative_model is None:
        raise ConfigError("--num-speculative-tokens needs --speculative-model DIR or [ngram] (or use --speculative-config)")
    d: dict = {"num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens is not None else {}
    if speculative_model in ("[ngram]", "ngram"):
        d["method"] = "ngram"
    elif speculative_model == "[suffix]":
        d["method"] = "suffix"
    else:
        d.update(method="draft_model", model=speculative_model)
    return d
