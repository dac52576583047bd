"""The speculative decoder: asks the proposer for drafts before each step, keeps acceptance
statistics, and stops speculating for sequences whose drafts are rarely accepted.

The engine calls `propose(running)` before scheduling (drafts go into seq.spec_token_ids; the
scheduler runs them after the sequence's next token), `on_verified(seq, verdict)` after the
step's verification, and `release(seq)` when a sequence finishes or is aborted.
"""
from __future__ import annotations

import logging
from collections import deque

from pagedserve.spec.config import SpeculativeConfig

log = logging.getLogger("pagedserve")


class SpecStats:
    """Cumulative counters, named as vLLM's spec_decode_* metrics."""

    def __init__(self, k: int):
        self.num_drafts = 0  # verification runs (one per sequence and step with drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k

    def snapshot(self) -> "SpecStats":
        copy = SpecStats(0)
        copy.__dict__.update(self.__dict__, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))
        return copy

    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class _SeqState:
    __slots__ = ("disabled", "recent", "recent_drafted", "recent_accepted")

    def __init__(self):
        self.disabled = False
        self.recent: deque = deque()  # (drafted, accepted) per verification, newest last
        self.recent_drafted = 0
        self.recent_accepted = 0


class SpeculativeDecoder:
    def __init__(self, cfg: SpeculativeConfig, proposer, max_model_len: int):
        self.cfg = cfg
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats(cfg.num_speculative_tokens)

    @property
    def method(self) -> str:
        return self.cfg.method

    def propose(self, running: list) -> None:
        cfg = self.cfg
        if cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size:
            return
        seqs, ks = [], []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1:  # still prefilling
                continue
            if seq.matcher is not None:  # drafts are not checked against a grammar: constrained ones decode one by one
                continue
            state = seq.spec if seq.spec is not None else _SeqState()
            seq.spec = state
            if state.disabled:
                continue
            # room for every draft and the target's own token, within max_tokens and max_model_len
            k = min(cfg.num_speculative_tokens, self.max_model_len - seq.num_tokens,
                    seq.params.max_tokens - seq.num_output_tokens - 1)
            if k >= 1:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.spec_token_ids = list(draft)

    def on_verified(self, seq, verdict) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += verdict.num_drafts
        st.num_accepted_tokens += verdict.num_accepted
        for j in range(verdict.num_accepted):
            st.num_accepted_tokens_per_pos[j] += 1
        self._track_acceptance(seq, verdict)

    def _track_acceptance(self, seq, verdict) -> None:
        cfg = self.cfg
        if not cfg.acceptance_disable_threshold or seq.spec is None:
            return
        state = seq.spec
        state.recent.append((verdict.num_drafts, verdict.num_accepted))
        state.recent_drafted += verdict.num_drafts
        state.recent_accepted += verdict.num_accepted
        while state.recent_drafted - state.recent[0][0] >= cfg.acceptance_window:
            d, a = state.recent.popleft()
            state.recent_drafted -= d
            state.recent_accepted -= a
        if (state.recent_drafted >= cfg.acceptance_window
                and state.recent_accepted < cfg.acceptance_disable_threshold * state.recent_drafted):
            state.disabled = True  # drafting for it costs more than it saves
            self.proposer.release(seq, finished=False)

    def release(self, seq) -> None:
        self.proposer.release(seq, finished=True)
        seq.spec_token_ids = []


def build_decoder(cfg: SpeculativeConfig, engine) -> SpeculativeDecoder:
    """The decoder for cfg's method; a draft model is loaded and checked here."""
    if cfg.method == "ngram":
        from pagedserve.spec.ngram import NgramProposer

        proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    elif cfg.method == "suffix":
        from pagedserve.spec.suffix import SuffixProposer

        proposer = SuffixProposer(cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
                                  cfg.suffix_decoding_min_token_prob)
    else:
        from pagedserve.spec.draft_model import DraftModelProposer

        proposer = DraftModelProposer(cfg, engine)
    log.info("speculative decoding: %s, %d tokens per step", cfg.method, cfg.num_speculative_tokens)
    return SpeculativeDecoder(cfg, proposer, engine.config.max_model_len)
