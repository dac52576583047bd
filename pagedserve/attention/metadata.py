"""What attention needs to know about one flat, padding-free token batch.

The model runner describes the batch once (`FlatBatch`, numpy arrays); the attention backend chosen
at start builds its own `AttentionMetadata` from it (`build_metadata`): the CPU paged kernel wants
block tables, the portable torch path gathered slots, the CUDA kernels int32 block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class FlatBatch:
    """The schedule of one step as index arrays (sequences sorted: decodes first)."""

    block_size: int
    block_tables: np.ndarray  # [B, max_blocks] int64
    starts: np.ndarray  # [B] tokens already in the cache before this step
    seq_lens: np.ndarray  # [B] context after this step
    query_starts: np.ndarray  # [B + 1] cumulative new tokens
    slots: np.ndarray  # [T] cache slot of every new token
    num_decodes: int  # the first num_decodes sequences have one new token each
    device: torch.device

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)


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
    decode_slots: torch.Tensor | None = None  # [B_decode, max_context] int64 cache slots (padded)
    decode_mask: torch.Tensor | None = None  # [B_decode, 1, 1, max_context] bool: True where a key is real
    prefills: list[PrefillSpan] | None = None
    # CPU paged kernel: the whole batch attends straight from the cache. Block tables, context
    # lengths and query offsets of every sequence, int64.
    paged_block_tables: torch.Tensor | None = None
    paged_seq_lens: torch.Tensor | None = None
    paged_query_starts: torch.Tensor | None = None  # [B + 1]
    # kernel-style views of the same batch (CUDA kernels)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    query_start_loc: torch.Tensor | None = None  # [B+1] int32
    block_size: int | None = None  # tokens per cache block (to view the flat caches as pages)
    max_decode_seq_len: int | None = None  # host-side hint for the decode split-K factor; None in CUDA graphs


def prefill_spans(batch: FlatBatch, with_context_slots: bool) -> list[PrefillSpan]:
    """The batch's prompts and prompt chunks; with_context_slots gathers the cache slots of a
    chunk's whole context (for a backend that reads the context by slot)."""
    bs, tables, cu, seq_lens = batch.block_size, batch.block_tables, batch.query_starts, batch.seq_lens
    spans = []
    for i in range(batch.num_decodes, len(seq_lens)):
        ctx_slots = None
        if with_context_slots and batch.starts[i] > 0:
            pos = np.arange(int(seq_lens[i]))
            ctx_slots = batch.tensor(tables[i, pos // bs] * bs + pos % bs)
        spans.append(PrefillSpan(int(cu[i]), int(cu[i + 1]), int(seq_lens[i]), ctx_slots))
    return spans


def kernel_metadata(batch: FlatBatch) -> AttentionMetadata:
    """Block-table metadata for the CUDA kernels (Triton, flash-attn): no gathers."""
    nd = batch.num_decodes
    block_tables, seq_lens, query_start_loc = (
        batch.tensor(a.astype(np.int32)) for a in (batch.block_tables, batch.seq_lens, batch.query_starts))
    return AttentionMetadata(
        slot_mapping=batch.tensor(batch.slots), num_decode_tokens=nd,
        prefills=prefill_spans(batch, with_context_slots=False),
        block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc, block_size=batch.block_size,
        max_decode_seq_len=int(batch.seq_lens[:nd].max()) if nd else None)
