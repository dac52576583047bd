"""Prompt lookup (vLLM's "ngram" method): drafts copied from earlier in the sequence.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up among the
sequence's earlier tokens; at the latest earlier occurrence of the longest n that matches, the
tokens that followed it are the draft. Costs one vectorised scan per sequence and step, no model
(then a few over the positions still matching as n grows).
"""
from __future__ import annotations

import numpy as np


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
        # ends[i] = i: earlier positions where the last n tokens end too, narrowed as n grows
        # (one comparison over the sequence, then a few over the survivors)
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        best = int(ends[-1]) if ends.size and self.min_n == 1 else -1
        n = 1
        while n < min(self.max_n, length - 1) and ends.size:
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
            n += 1
            if ends.size and n >= self.min_n:
                best = int(ends[-1])  # the latest occurrence of the longest match
        return token_ids[best + 1:best + 1 + k] if best >= 0 else []

    def release(self, seq, finished: bool = True) -> None:
        pass
