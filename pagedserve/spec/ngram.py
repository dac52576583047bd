"""Prompt lookup (vLLM's "ngram" method): drafts copied from earlier in the sequence.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up among the
sequence's earlier tokens; at the latest earlier occurrence of the longest n that matches, the
tokens that followed it are the draft. Costs one vectorised scan per sequence and step, no model.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self.lookup(s.token_ids, k) for s, k in zip(seqs, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        if length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []

    def release(self, seq, finished: bool = True) -> None:
        pass
