"""Compiling constraints with llguidance: one matcher template per distinct constraint, cached.

llguidance (guidance-ai, Rust, on PyPI with no Python dependencies) computes a token mask for a
grammar state in tens of microseconds without precompiling per-state tables, so a new JSON schema
costs milliseconds, not seconds; it takes JSON schema, regex and Lark/GBNF grammars natively.
xgrammar was the other candidate: its wheel requires torch, transformers and triton (a second
torch build for a CPU install) where llguidance's requires nothing.
A compiled matcher is kept as a template: each sequence gets a deep copy (cheap) of it.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

from pagedserve.errors import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams

log = logging.getLogger("pagedserve.structured")

_CACHE_SIZE = 512  # distinct constraints kept compiled (a template is a few kB to a few MB)


def _grammar_text(so: StructuredOutputsParams, param: str) -> str:
    """The constraint as an llguidance grammar (its JSON form); InvalidRequestError naming what is wrong."""
    import llguidance

    kind = so.kind()
    # compact JSON unless a whitespace pattern is asked for: a flexible one lets a model pad forever
    options = {"whitespace_flexible": False} if so.whitespace_pattern is None else {
        "whitespace_pattern": so.whitespace_pattern}
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {e}.", param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}.",
                                      param)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        if not isinstance(so.regex, str):
            raise InvalidRequestError(f"{param}: regex must be a string.", param)
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        if (not isinstance(so.choice, list) or not so.choice
                or not all(isinstance(c, str) and c for c in so.choice)):
            raise InvalidRequestError(f"{param}: choice must be a non-empty list of non-empty strings.", param)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if not isinstance(so.grammar, str) or not so.grammar.strip():
        raise InvalidRequestError(f"{param}: grammar must be a non-empty string (Lark or GBNF).", param)
    try:
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InvalidRequestError(f"{param}: invalid grammar: {e}", param) from None


class GrammarCompiler:
    """Turns StructuredOutputsParams into per-sequence matchers for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = eos_ids  # a callable: the engine's EOS ids may be changed after start-up
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _tokenizer(self):
        """Built on first use (about a second for a 150k vocabulary)."""
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                # the mask is as wide as the logits (a tokenizer larger than the model's vocabulary fails here)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=sorted(self._eos_ids()))
            except (ValueError, AttributeError, TypeError) as e:
                raise InvalidRequestError(f"structured outputs need a Hugging Face fast tokenizer; this model's "
                                          f"tokenizer cannot be used ({e}).", "structured_outputs") from None
        return self._ll_tokenizer

    def matcher(self, so: StructuredOutputsParams):
        """A fresh llguidance.LLMatcher at the start of the constraint; InvalidRequestError if the
        schema, regex or grammar is invalid."""
        import llguidance

        param = so.param
        key = so.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        text = _grammar_text(so, param)
        template = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"{param}: invalid {so.kind().replace('_', ' ')} constraint: "
                                      f"{template.get_error().strip()}", param)
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()
