"""What attention needs to know about one flat, padding-free token batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One sequence of the batch with more than one new token (a prompt or a prompt chunk)."""

    q_start: int  # its tokens in the flat batch: [q_start, q_end)
    q_end: int
    context_len: int  # tokens of context after this step (earlier chunks + this one)
    context_slots: torch.Tensor | None  # cache slots of the whole context; None when no earlier chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    num_decode_tokens: int  # the batch starts with this many one-token sequences
    decode_slots: torch.Tensor | None  # [B_decode, max_context] int64 cache slots (padded)
    decode_mask: torch.Tensor | None  # [B_decode, 1, 1, max_context] bool: True where a key is real
    prefills: list[PrefillSpan]
    # CPU native paged kernel: num_paged_tokens is the batch's token count when the kernel attends
    # the whole batch straight from the cache (no gather), else 0. Block tables, context lengths
    # and query offsets of every sequence, int64.
    num_paged_tokens: int = 0
    paged_block_tables: torch.Tensor | None = None
    paged_seq_lens: torch.Tensor | None = None
    paged_query_starts: torch.Tensor | None = None  # [B_paged + 1]
    # kernel-style views of the same batch (used by CUDA kernels; cheap to build)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    query_start_loc: torch.Tensor | None = None  # [B+1] int32
    block_size: int | None = None  # tokens per cache block (to view the flat caches as pages)
    max_decode_seq_len: int | None = None  # host-side hint for the decode split-K factor; None in CUDA graphs
