"""Attention over the paged KV cache on the CPU (and the portable fallback anywhere).

With the native CPU kernel, the whole batch (decodes, fresh prompts, prompt chunks with earlier
context from chunked prefill or prefix-cache hits) attends straight from the block pool in one
call. Without the kernel (no compiler, other devices), decodes gather their contexts by slot
index into one padded tensor for a single SDPA call, a prompt's first chunk uses SDPA over its
own fresh K/V with a causal mask, and later chunks gather their context one sequence at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch-sdpa"

    def __init__(self):
        self._native: dict = {}

    def native_decode(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the native CPU kernel (reads the pool in place) replaces the gathers."""
        key = (device.type, dtype)
        if key not in self._native:
            from pagedserve.kernels.cpu import paged_attention as cpu_kernels

            self._native[key] = device.type == "cpu" and cpu_kernels.supports(dtype) and cpu_kernels.load() is not None
            if self._native[key]:
                self.name = "torch-sdpa + native CPU paged attention"
        return self._native[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, h, d]; k, v: [T, kvh, d]; caches: [num_slots, kvh, d] (flat view of the blocks)."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.num_paged_tokens:  # the native kernel takes the whole batch
            return self._paged(q, k_cache, v_cache, meta, scale)
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

    def attend_cached(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """forward() for a native-kernel batch (meta.num_paged_tokens set) whose new K/V are
        already in the cache."""
        return self._paged(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _paged(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from pagedserve.kernels.cpu.paged_attention import paged_attention

        shape = (-1, meta.block_size) + tuple(k_cache.shape[1:])
        return paged_attention(q, k_cache.view(shape), v_cache.view(shape), meta.paged_block_tables,
                               meta.paged_seq_lens, meta.paged_query_starts, scale)
