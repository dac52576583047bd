"""Attention over the paged KV cache with pagedserve's own Triton kernels (kernels/triton/paged_attention.py).

Same `forward` contract as the torch backend. The caches arrive as flat [num_slots, kvh, d] views
of the [num_blocks, block_size, kvh, d] pools and are viewed back (no copy). The batch is the
model runner's flat one: the first `meta.num_decode_tokens` rows are one-token decodes, attended
by the split-K decode kernel; the rest are prefill chunks (chunked prefill included), attended by
the prefill kernel, which reads every key, the new ones too, from the cache — so K/V are stored
first. Builds the kernel-style metadata (block_tables, seq_lens, query_start_loc, block_size);
`needs_block_tables` marks it graph-safe (CUDA graphs replay block-table metadata).

Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1; slow, used by tests).
The interpreter runs every tile element by element in Python, so there the tiles shrink to 16
(the kernels' minimum for tl.dot) to waste less time on padding; on the GPU they stay 64.
"""
from __future__ import annotations

import os

import torch

from pagedserve.kernels.triton import paged_attention as tk
from pagedserve.attention.metadata import AttentionMetadata, FlatBatch, kernel_metadata


def paged_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, kvh, d] -> [num_blocks, block_size, kvh, d] (a view)."""
    n, kvh, d = cache.shape
    return cache.view(n // block_size, block_size, kvh, d)


class TritonAttentionBackend:
    name = "triton"
    needs_block_tables = True

    def __init__(self, block_size: int | None = None):
        if not tk.triton_available():
            raise RuntimeError("triton is not installed: the Triton attention backend cannot be used")
        self.block_size = block_size
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        self.block_m = 16 if interp else 64  # (token, query head) rows per prefill program
        self.block_n = 16 if interp else 64  # keys per inner-loop tile
        self.num_splits = 2 if interp else None  # decode split-K; None: from the shapes (choose_num_splits)

    def build_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        return kernel_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, h, d]; k, v: [T, kvh, d]; caches: [num_slots, kvh, d] (flat views of the blocks)."""
        bs = meta.block_size or self.block_size
        if bs is None or meta.block_tables is None or meta.seq_lens is None:
            raise RuntimeError("the Triton backend needs block_size, block_tables and seq_lens in AttentionMetadata")
        kc, vc = paged_view(k_cache, bs), paged_view(v_cache, bs)
        tk.store_kv(k, v, kc, vc, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        T = q.shape[0]
        if nd:
            tk.paged_decode_attention(
                q[:nd], kc, vc, meta.block_tables[:nd], meta.seq_lens[:nd], scale, self.num_splits,
                max_seq_len=meta.max_decode_seq_len, block_n=self.block_n, out=out[:nd],
            )
        if nd < T:
            qsl = meta.query_start_loc[nd:]
            if nd:
                qsl = qsl - nd
            tk.paged_prefill_attention(
                q[nd:], kc, vc, meta.block_tables[nd:], qsl, meta.seq_lens[nd:], scale,
                block_m=self.block_m, block_n=self.block_n, out=out[nd:],
            )
        return out
