"""KV block bookkeeping: free list, block tables, reference counts, prefix-cache hashes.

Pure Python (no torch). Every operation is O(1) per block. A block is either in use
(ref_count > 0) or in the free list; a free block that still carries a hash is also a cache
entry and is reused by a later request with the same prefix until its space is needed. The free
list is ordered least-recently-used first, so eviction takes the oldest cache entries.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_key: list = [None] * num_blocks  # hash key of a full, computed block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict = {}  # hash key -> block id
        # prefix-cache statistics, in tokens
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self.free)

    # ---- allocation -----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently used first
        key = self.block_key[block]
        if key is not None:  # evict its cache entry: the space is needed now
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make seq's block table cover num_tokens tokens. Caller checked can_grow()."""
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (speculative decoding's rejected
        drafts). Those blocks were taken by grow() for this sequence alone and never hashed."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)  # holds nothing worth keeping: reuse first

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the (more shareable) head blocks.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_key[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # holds nothing worth keeping: reuse first
                else:
                    self.free[block] = None  # most recently used end
        seq.block_table = []

    # ---- prefix caching -------------------------------------------------------------------
    def _key(self, parent_key, tokens: tuple) -> tuple:
        return (hash(parent_key), tokens)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest run of cached full blocks of seq's tokens; return tokens matched.

        The block holding the last token is never matched, so at least one token is computed
        (its logits start the generation) and a shared block is never written.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        parent = None
        matched: list[int] = []
        for i in range(max_blocks):
            key = self._key(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            block = self.cached.get(key)
            if block is None:
                break
            matched.append(block)
            parent = key
        for block in matched:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table = matched
        seq.num_hashed_blocks = len(matched)
        seq.last_block_key = parent
        return len(matched) * bs

    def count_lookup(self, seq: Sequence, matched_tokens: int) -> None:
        """Count one prefix-cache lookup, made by a request the scheduler admits. A request left
        waiting looks up again next step; counting only admissions keeps those retries from
        adding queries (and lowering the reported hit rate) under load."""
        self.query_tokens += seq.num_tokens
        self.hit_tokens += matched_tokens

    def undo_match(self, seq: Sequence) -> None:
        """Give back blocks attached by match_prefix when the request cannot be admitted now."""
        self.free_seq(seq)
        seq.num_hashed_blocks = 0
        seq.last_block_key = None

    def commit_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register a hash for every full block among seq's first num_tokens tokens.

        Called when those tokens are scheduled, before they are computed: a request admitted later
        in the same step may then share them, because every layer writes the whole batch's K/V into
        the cache before any sequence's attention reads it.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = num_tokens // bs
        parent = seq.last_block_key
        for i in range(seq.num_hashed_blocks, full):
            key = self._key(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            block = seq.block_table[i]
            if key not in self.cached:
                self.cached[key] = block
                self.block_key[block] = key
            parent = key
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
        seq.last_block_key = parent

    def reset_prefix_cache(self) -> None:
        for key, block in list(self.cached.items()):
            if self.ref_counts[block] == 0:
                self.block_key[block] = None
                del self.cached[key]
