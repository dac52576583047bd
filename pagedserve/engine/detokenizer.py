"""Incremental detokenization with stop-string handling.

Text is produced by decoding a small sliding window of tokens and emitting only what is new and
complete: a window whose decode ends in U+FFFD is an unfinished multi-byte character, so nothing
is emitted until the next token completes it. Text that could still be the start of a stop
string is held back, so the text a client has seen is always a prefix of the final text.
"""
from __future__ import annotations

_LOOKBACK = 6  # tokens of context decoded before the new ones (tokenizers merge spaces per word)


def fast_decode(tokenizer):
    """tokenizer.decode, or the same decode of its Rust `tokenizers` backend called directly.

    transformers' decode wraps the backend's in argument conversion that cost more than the
    decode itself (two calls per generated token: ~8 ms of a 256-sequence step). The backend is
    used only when transformers would return its text unchanged (no clean-up of spaces).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "decode", "skip_special", "prefix_offset", "read_offset", "text", "stops",
                 "max_stop_len", "include_stop", "stopped_on")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stops: list[str], include_stop: bool,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = fast_decode(tokenizer)
        self.skip_special = skip_special_tokens
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(0, self.read_offset - _LOOKBACK)
        self.text = ""
        self.stops = stops
        self.max_stop_len = max((len(s) for s in stops), default=0)
        self.include_stop = include_stop
        self.stopped_on: str | None = None

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> None:
        """token_ids: the whole sequence (prompt + output), after new tokens were appended."""
        dec = self.decode
        prefix = dec(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = dec(token_ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            self._append(new, check_stop)

    def flush(self, token_ids: list[int]) -> None:
        """At the end: emit what is still pending, even an incomplete character (as U+FFFD)."""
        if self.read_offset >= len(token_ids) or self.stopped_on is not None:
            return
        dec = self.decode
        prefix = dec(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = dec(token_ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        self.read_offset = len(token_ids)
        if len(full) > len(prefix):
            self._append(full[len(prefix):], check_stop=False)

    def _append(self, new: str, check_stop: bool) -> None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new
        if not self.stops or not check_stop:
            return
        # Only look where a stop string could newly appear: overlapping the added text.
        best = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_on = s

    def visible_text(self, finished: bool) -> str:
        """The text that is safe to show: all of it once finished, else minus a possible stop prefix."""
        if finished or self.max_stop_len <= 1 or self.stopped_on is not None:
            return self.text
        hold = self.max_stop_len - 1
        # hold back only a tail that really is a prefix of some stop string
        for k in range(min(hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return self.text[:-k]
        return self.text
