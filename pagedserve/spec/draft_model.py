"""A smaller model with the target's tokenizer drafts K tokens greedily, for all sequences batched.

The draft keeps its own paged KV cache (its own block pool, as many tokens as the target's) and a
shadow sequence per target sequence. Each step it first catches up on the tokens the target
accepted since the last draft (or the whole prompt, in chunks within the step's token budget),
which yields the first draft token, then runs K - 1 one-token steps for the whole batch. The
shadow's KV stays valid up to the first token where its drafts and the target's tokens differ.
"""
from __future__ import annotations

import logging

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagedserve.engine.sequence import Request
from pagedserve.errors import ConfigError
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger("pagedserve")


def load_draft(cfg, engine):
    """Load the draft model and check that it can draft for the engine's target."""
    from pagedserve.model.loader import load_model

    ecfg = engine.config
    loaded = load_model(cfg.model, dtype=ecfg.dtype, device=engine.device)
    where = f"--speculative-config: the draft model {cfg.model!r}"
    if loaded.spec.vocab_size != engine.spec.vocab_size or loaded.tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise ConfigError(f"{where} has another vocabulary than the target ({loaded.spec.vocab_size} vs "
                          f"{engine.spec.vocab_size} ids, or different tokens); draft and target must share the "
                          "tokenizer")
    if loaded.spec.max_position_embeddings < ecfg.max_model_len:
        raise ConfigError(f"{where} handles {loaded.spec.max_position_embeddings} positions, fewer than "
                          f"max_model_len={ecfg.max_model_len}; use --max-model-len "
                          f"{loaded.spec.max_position_embeddings} or a draft with a longer context")
    return loaded


_DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class DraftModelProposer:
    def __init__(self, cfg, engine):
        loaded = load_draft(cfg, engine)
        ecfg = engine.config
        num_blocks = engine.block_manager.num_blocks
        # a runner of the target's kind: the same device path (packing, screen, attention backend)
        self.runner = type(engine.runner)(loaded.model, ecfg, engine.device)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = self.runner.kv
        self.bm = BlockManager(num_blocks, ecfg.block_size, enable_prefix_caching=False)
        self.token_budget = ecfg.max_num_batched_tokens
        self.shadows: dict[int, object] = {}  # target seq_id -> the draft's Sequence
        self.synced: dict[int, int] = {}  # target seq_id -> target tokens the shadow held at its last sync
        log.info("draft model %s (%s, %d layers), %d KV blocks of its own", cfg.model, loaded.spec.architecture,
                 loaded.spec.num_layers, num_blocks)

    def _shadow(self, seq):
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = Request(f"draft-{seq.seq_id}", None, list(seq.token_ids), _DRAFT_PARAMS).seqs[0]
            self.shadows[seq.seq_id] = sh
            self.synced[seq.seq_id] = len(seq.token_ids)
            return sh
        # the KV stays valid up to the first token where the last drafts and the target's tokens
        # part; the tokens before the last sync are the target's own, equal on both sides
        old, new = sh.token_ids, seq.token_ids
        end = min(sh.num_computed_tokens, len(new), len(old))
        j = min(self.synced[seq.seq_id], end)
        while j < end and old[j] == new[j]:
            j += 1
        sh.num_computed_tokens = j
        sh.token_ids = list(new)
        self.synced[seq.seq_id] = len(new)
        return sh

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        budget = self.token_budget
        first, active = [], []  # catch-up entries; (shadow, k, target length) that draft this step
        for seq, k in zip(seqs, ks):
            sh = self._shadow(seq)
            need = sh.num_tokens - sh.num_computed_tokens
            n = min(need, budget)
            if n <= 0 or not self.bm.can_grow(sh, sh.num_tokens + k - 1):
                continue
            self.bm.grow(sh, sh.num_tokens + k - 1)
            first.append(ScheduledSeq(sh, n, sh.num_computed_tokens))
            budget -= n
            if n == need:
                active.append((sh, k, sh.num_tokens))
        if first:
            self._run(first)
        for r in range(1, max((k for _, k, _ in active), default=1)):
            self._run([ScheduledSeq(sh, 1, sh.num_tokens - 1) for sh, k, _ in active if k > r])
        drafts = {id(sh): sh.token_ids[n:n + k] for sh, k, n in active}
        return [drafts.get(id(self.shadows.get(s.seq_id)), []) for s in seqs]

    def _run(self, entries: list) -> None:
        result = self.runner.execute(SchedulerOutput(scheduled=entries))
        for e in entries:
            e.seq.num_computed_tokens = e.start + e.num_new_tokens
        for e, tok in result.sampled:
            e.seq.token_ids.append(tok.token_id)

    def release(self, seq, finished: bool = True) -> None:
        sh = self.shadows.pop(seq.seq_id, None)
        self.synced.pop(seq.seq_id, None)
        if sh is not None:
            self.bm.free_seq(sh)
