"""Attention with FlashAttention's paged-KV kernels (CUDA only).

UNVERIFIED: written against the documented flash-attn / vllm-flash-attn Python APIs and never run:
pagedserve's development machines have no GPU and no flash-attn build. It is only selected on CUDA
(by default only when a build that accepts the engine's block sizes is importable); the Triton
backend is the tested CUDA path. Run benchmarks/gpu_check.sh with PAGEDSERVE_ATTENTION_BACKEND=flash-attn
on a GPU machine before trusting it.

- K/V store: the Triton `store_kv` kernel when triton imports, else torch `index_copy_` on the flat views.
- Decode (the leading one-token sequences): `flash_attn_with_kvcache(q[B,1,h,d], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=block_tables)`.
- Prefill chunks: `flash_attn_varlen_func(..., causal=True, block_table=...)`, keys read from the paged
  cache; with q shorter than k, flash-attn (>= 2.1) aligns the causal mask to the bottom right, which
  is exactly chunked prefill.

Upstream flash-attn 2 requires the page (block) size to be a multiple of 256, above every block size
pagedserve supports (8..128), so only vLLM's fork (`vllm_flash_attn`, pages of any multiple of 16) is
usable; `load_flash_attn(block_size)` says why when neither fits.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.triton import paged_attention as tk
from pagedserve.attention.metadata import AttentionMetadata, FlatBatch, kernel_metadata
from pagedserve.attention.triton_backend import paged_view


def load_flash_attn(block_size: int | None):
    """(module, flavour) of a flash-attn build usable with block_size; RuntimeError saying why not."""
    reasons = []
    try:
        import vllm_flash_attn as fa  # vLLM's fork: seqused_k, any page size that is a multiple of 16

        if block_size is None or block_size % 16 == 0:
            return fa, "vllm"
        reasons.append(f"vllm_flash_attn needs a block size that is a multiple of 16, got {block_size}")
    except Exception as e:  # ImportError, or a build that fails to load its CUDA library
        reasons.append(f"vllm_flash_attn: {type(e).__name__}: {e}")
    try:
        import flash_attn as fa

        if block_size is not None and block_size % 256 == 0:
            return fa, "upstream"
        reasons.append(
            f"flash_attn {getattr(fa, '__version__', '?')} is installed but its paged KV cache needs a block "
            f"size that is a multiple of 256 (--block-size {block_size} is used; pagedserve supports 8..128)"
        )
    except Exception as e:
        reasons.append(f"flash_attn: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(reasons))


class FlashAttnBackend:
    name = "flash-attn"
    needs_block_tables = True

    def __init__(self, block_size: int | None = None):
        self.fa, self.flavour = load_flash_attn(block_size)
        self.name = f"flash-attn ({'vllm_flash_attn' if self.flavour == 'vllm' else 'flash_attn'}, unverified)"
        self.block_size = block_size
        self._triton_store = tk.triton_available()

    def build_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        return kernel_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        bs = meta.block_size or self.block_size
        kc, vc = paged_view(k_cache, bs), paged_view(v_cache, bs)
        if self._triton_store:
            tk.store_kv(k, v, kc, vc, meta.slot_mapping)  # skips slot -1 (CUDA-graph padding rows)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)  # no padding rows in eager batches
            v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            o = self.fa.flash_attn_with_kvcache(
                q[:nd].unsqueeze(1), kc, vc, cache_seqlens=meta.seq_lens[:nd],
                block_table=meta.block_tables[:nd], softmax_scale=scale, causal=True,
            )
            out[:nd] = o.squeeze(1)
        if meta.prefills:
            qsl = meta.query_start_loc[nd:]
            if nd:
                qsl = qsl - nd
            seq_lens = meta.seq_lens[nd:]
            max_q = max(p.q_end - p.q_start for p in meta.prefills)
            max_k = max(p.context_len for p in meta.prefills)
            kw = dict(q=q[nd:], k=kc, v=vc, cu_seqlens_q=qsl, max_seqlen_q=max_q, max_seqlen_k=max_k,
                      softmax_scale=scale, causal=True, block_table=meta.block_tables[nd:])
            if self.flavour == "vllm":
                kw["seqused_k"] = seq_lens
            else:
                cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
                torch.cumsum(seq_lens, 0, out=cu_k[1:])
                kw["cu_seqlens_k"] = cu_k
            out[nd:] = self.fa.flash_attn_varlen_func(**kw)
        return out
