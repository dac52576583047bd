"""Continuous-batching scheduler: which tokens of which sequences run this step.

Each step packs the running sequences first (decodes, or the next chunk of a prefill), then
admits waiting sequences in arrival order, all within `max_num_seqs` and the token budget
`max_num_batched_tokens`. A prompt longer than the remaining budget is split across steps
(chunked prefill). When the pool runs out of blocks, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens.
Pure Python: no torch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # the KV of tokens [start, start + num_new_tokens) is computed this step
    start: int
    # speculative decoding: the last num_spec_tokens of the new tokens are seq.spec_token_ids
    # (drafts after the sequence's last token), verified by this step's forward
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a (finished or aborted) sequence out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free_seq(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1

    def _num_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of seq's draft tokens run this step: only after a decode's one new token, within
        the token budget, and none when the pool cannot hold them (drafts never cause preemption)."""
        if n != 1 or not seq.spec_token_ids:
            return 0
        drafts = min(len(seq.spec_token_ids), budget - 1)
        if not self.bm.can_grow(seq, seq.num_tokens + drafts):
            drafts = 0
        del seq.spec_token_ids[drafts:]
        return drafts

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.bm

        # 1. Running sequences, oldest admission first; preempt from the newest end when short.
        queue = deque(self.running)
        still_running: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                still_running.append(seq)
                continue
            drafts = self._num_drafts(seq, n, budget)
            target = seq.num_computed_tokens + n + drafts
            while not bm.can_grow(seq, target):
                if queue:
                    self._preempt(queue.pop(), out)
                else:
                    self._preempt(seq, out)
                    seq = None
                    break
            if seq is None:
                break
            bm.grow(seq, target)
            bm.commit_blocks(seq, target - drafts)  # drafts are never hashed
            out.scheduled.append(ScheduledSeq(seq, n + drafts, seq.num_computed_tokens, drafts))
            budget -= n + drafts
            still_running.append(seq)
        self.running = still_running

        # 2. Waiting sequences in arrival order (none admitted in a step that had to preempt).
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            wants_prompt_logprobs = seq.request.prompt_logprobs is not None
            if not wants_prompt_logprobs:  # cached tokens would have no prompt logprobs
                seq.num_computed_tokens = bm.match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if (n < remaining and not self.enable_chunked_prefill) or not bm.can_grow(seq, seq.num_computed_tokens + n):
                if seq.block_table:
                    bm.undo_match(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            m = seq.request.metrics
            if m.num_cached_tokens is None:  # the first admission's prefix-cache hit (vLLM's cached tokens)
                m.num_cached_tokens = seq.num_computed_tokens
            if not wants_prompt_logprobs and bm.enable_prefix_caching:
                bm.count_lookup(seq, seq.num_computed_tokens)
            bm.grow(seq, seq.num_computed_tokens + n)
            bm.commit_blocks(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
        return out
