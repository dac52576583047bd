"""Portable attention over the paged KV cache with torch's SDPA: runs on any device.

Decodes gather their contexts by slot index into one padded tensor for a single SDPA call, a
prompt's first chunk uses SDPA over its own fresh K/V with a causal mask, and later chunks gather
their context one sequence at a time. The CPU uses it when the native paged kernel is off or
cannot be built (attention/cpu_backend.py is the fast path there).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata, FlatBatch, prefill_spans


class TorchAttentionBackend:
    name = "torch-sdpa"

    def build_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        nd, bs = batch.num_decodes, batch.block_size
        decode_slots = decode_mask = None
        if nd:
            d_lens = batch.seq_lens[:nd]
            pos = np.arange(int(d_lens.max()))
            decode_slots = batch.tensor(batch.block_tables[:nd, pos // bs] * bs + pos % bs)
            decode_mask = batch.tensor(pos[None, :] < d_lens[:, None])[:, None, None, :]
        return AttentionMetadata(slot_mapping=batch.tensor(batch.slots), num_decode_tokens=nd,
                                 decode_slots=decode_slots, decode_mask=decode_mask,
                                 prefills=prefill_spans(batch, with_context_slots=True), block_size=bs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, h, d]; k, v: [T, kvh, d]; caches: [num_slots, kvh, d] (flat view of the blocks)."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, kvh, L, d]
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [B, h, 1, d]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            qs = q[p.q_start:p.q_end].transpose(0, 1)  # [h, n, d]
            if p.context_slots is None:
                ks = k[p.q_start:p.q_end].transpose(0, 1)
                vs = v[p.q_start:p.q_end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ks = k_cache[p.context_slots].transpose(0, 1)  # [kvh, L, d]
                vs = v_cache[p.context_slots].transpose(0, 1)
                n = p.q_end - p.q_start
                q_pos = torch.arange(p.context_len - n, p.context_len, device=q.device)
                mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[p.q_start:p.q_end] = o.transpose(0, 1)
        return out
