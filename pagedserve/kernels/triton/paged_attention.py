"""Triton kernels for the paged KV cache: store, decode (split-K) and prefill (chunked, causal).

KV-cache layout (the contract with the engine), per layer:
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of sequence s lives in block ``block_tables[s, p // block_size]`` at offset
``p % block_size``; ``slot_mapping[t] = block * block_size + offset`` for each new token (-1 = skip).
GQA: query head h reads kv head ``h // (num_heads // num_kv_heads)``.

Design notes
- K/V are gathered token by token through the block table (page = pos // block_size), so a KV tile
  of BLOCK_N tokens may span several pages and block_size needs not be a power of two.
- The query heads sharing one kv head are processed by the same program (rows of one tile), so each
  K/V tile is read once per kv head, not once per query head.
- Decode splits each context into NUM_SPLITS contiguous ranges (split-K). Every split writes a
  normalised partial output and its log-sum-exp; a second kernel merges them. The number of splits
  depends only on shapes (and an optional host-side hint), never on device values, so the launch is
  safe to capture in a CUDA graph.
- Prefill covers chunked prefill: sequence s's queries are the last q_len_s positions of its
  context of length seq_lens[s]; the earlier positions are read from the cache. The launch grid is
  an upper bound computed from shapes only (cdiv(T, BLOCK_Q) + B tiles); each program finds its
  sequence by binary search over query_start_loc, so there is no host sync.
- Softmax runs in the exp2 domain with fp32 accumulation.

triton is imported lazily: this module imports without triton; `triton_available()` tells whether the
kernels can be used. Kernels are defined on first use, and TRITON_INTERPRET=1 (Triton's CPU
interpreter, used by the tests) is read at that moment.
"""

from __future__ import annotations

import functools
import math

import torch

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports (it still needs a GPU, or TRITON_INTERPRET=1, to run)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails at import
        return False
    return True


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise be multiplied in tf32 on Ampere+ (~1e-3 error); keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=1)
def _kernels():
    if not triton_available():
        raise RuntimeError("triton is not installed: the Triton attention backend cannot be used")
    import triton
    import triton.language as tl

    # Only core builtins and our own @jit helpers are used inside the kernels, never triton's @jit
    # standard library (tl.max, tl.sum, tl.zeros, tl.cdiv): those are decorated when triton.language
    # is imported, so if that happened before TRITON_INTERPRET=1 was set they stay GPU functions and
    # the interpreter refuses them. Ours are decorated here, on first use. tl.reduce with these
    # combine functions is what tl.max / tl.sum do, so the compiled GPU code is the same.
    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _sum_combine(a, b):
        return a + b

    @triton.jit
    def _rowmax(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _max_combine)

    @triton.jit
    def _rowsum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _sum_combine)

    # Triton's interpreter re-executes kernel source against the module's globals (closures are
    # lost), so the names the kernels use must be module globals; the GPU compiler finds them either way.
    globals().update(
        triton=triton, tl=tl, _max_combine=_max_combine, _sum_combine=_sum_combine,
        _rowmax=_rowmax, _rowsum=_rowsum,
    )

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_cs, stride_ch,
        stride_vcb, stride_vcs, stride_vch,
        block_size, head_dim,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // block_size
            off = slot % block_size
            d = tl.arange(0, BLOCK_D)
            dm = d < head_dim
            k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=dm)
            v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=dm)
            tl.store(kc_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d, k, mask=dm)
            tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=dm)

    @triton.jit
    def _decode_split_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
        qk_scale,  # scale * log2(e)
        stride_qb, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_btb,
        stride_ob, stride_oh,
        stride_mob, stride_moh, stride_mos,
        stride_mlb, stride_mlh,
        block_size, head_dim, group,
        G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, BLOCK_D)
        gm = g < group
        dm = d < head_dim
        heads = kvh * group + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)

        # split s covers whole BLOCK_N tiles [start, end) of the context
        num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: see the note in _kernels()
        tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.full([G_PAD], 0.0, tl.float32)
        acc = tl.full([G_PAD, BLOCK_D], 0.0, tl.float32)
        n_off = tl.arange(0, BLOCK_N)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n_off
            pm = pos < end
            page = tl.load(bt_row + pos // block_size, mask=pm, other=0).to(tl.int64)
            slot_off = pos % block_size
            k = tl.load(kc_ptr + page[:, None] * stride_kb + slot_off[:, None] * stride_ks
                        + kvh * stride_kh + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            qk = tl.where(pm[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, _rowmax(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + _rowsum(p, 1)
            v = tl.load(vc_ptr + page[:, None] * stride_vb + slot_off[:, None] * stride_vs
                        + kvh * stride_vh + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # log2 domain
            tl.store(mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos
                     + d[None, :], o, mask=gm[:, None] & dm[None, :])
            tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=gm)

    @triton.jit
    def _decode_reduce_kernel(
        mid_o_ptr, mid_lse_ptr, out_ptr,
        stride_mob, stride_moh, stride_mos,
        stride_mlb, stride_mlh,
        stride_ob, stride_oh,
        head_dim,
        NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, BLOCK_D)
        sm = s < NUM_SPLITS
        dm = d < head_dim
        lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=sm, other=float("-inf"))
        o = tl.load(mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
                    mask=sm[:, None] & dm[None, :], other=0.0)
        m = _rowmax(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0) -> zeros
        w = tl.exp2(lse - m_safe)
        den = _rowsum(w, 0)
        den = tl.where(den > 0, den, 1.0)
        res = _rowsum(o * w[:, None], 0) / den
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _prefill_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
        qk_scale,  # scale * log2(e)
        num_seqs,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_btb,
        stride_ot, stride_oh,
        block_size, head_dim, group,
        BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        tile = tl.program_id(0)
        kvh = tl.program_id(1)

        # Sequence s owns the tile ids [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1): at least
        # cdiv(q_len_s, BLOCK_Q) of them. Find the last s whose first tile id is <= tile.
        lo = tl.program_id(0) * 0
        hi = lo + num_seqs
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            go_right = first <= tile
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        s = lo
        q_start = tl.load(qsl_ptr + s)
        q_len = tl.load(qsl_ptr + s + 1) - q_start
        tile_in_seq = tile - (q_start // BLOCK_Q + s)
        if tile_in_seq * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + s)
            ctx_len = seq_len - q_len  # tokens before this chunk, already in the cache

            r = tl.arange(0, BLOCK_M)
            tok = tile_in_seq * BLOCK_Q + r // G_PAD  # query index inside this sequence's chunk
            g = r % G_PAD
            d = tl.arange(0, BLOCK_D)
            dm = d < head_dim
            row_ok = (tok < q_len) & (g < group)
            heads = kvh * group + g
            q_rows = (q_start + tok).to(tl.int64)
            q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & dm[None, :], other=0.0)
            q_pos = ctx_len + tok

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
            n_off = tl.arange(0, BLOCK_N)
            bt_row = bt_ptr + s.to(tl.int64) * stride_btb
            kv_end = tl.minimum(seq_len, ctx_len + (tile_in_seq + 1) * BLOCK_Q)  # causal bound
            for n0 in range(0, kv_end, BLOCK_N):
                pos = n0 + n_off
                pm = pos < kv_end
                page = tl.load(bt_row + pos // block_size, mask=pm, other=0).to(tl.int64)
                slot_off = pos % block_size
                k = tl.load(kc_ptr + page[:, None] * stride_kb + slot_off[:, None] * stride_ks
                            + kvh * stride_kh + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                causal = (pos[None, :] <= q_pos[:, None]) & pm[None, :]
                qk = tl.where(causal, qk, float("-inf"))
                m_new = tl.maximum(m_i, _rowmax(qk, 1))
                # rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_shift)
                p = tl.exp2(qk - m_shift[:, None])
                l_i = l_i * alpha + _rowsum(p, 1)
                v = tl.load(vc_ptr + page[:, None] * stride_vb + slot_off[:, None] * stride_vs
                            + kvh * stride_vh + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new

            l_safe = tl.where(l_i > 0, l_i, 1.0)
            o = acc / l_safe[:, None]
            tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])

    return {
        "store_kv": _store_kv_kernel,
        "decode_split": _decode_split_kernel,
        "decode_reduce": _decode_reduce_kernel,
        "prefill": _prefill_kernel,
    }


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key/value cache must be contiguous in head_dim")


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, num_kv_heads, head_dim] into the paged caches in place; slot -1 is skipped."""
    _check_cache(key_cache, value_cache)
    T, kvh, d = key.shape
    if value.shape != key.shape or slot_mapping.shape[0] < T:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, slots {tuple(slot_mapping.shape)}")
    if key_cache.shape[2] != kvh or key_cache.shape[3] != d:
        raise ValueError(f"cache {tuple(key_cache.shape)} does not match key {tuple(key.shape)}")
    if T == 0:
        return
    key, value = _heads_contiguous(key), _heads_contiguous(value)
    k = _kernels()["store_kv"]
    k[(T, kvh)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1], d,
        BLOCK_D=_next_pow2(d),
    )


def choose_num_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int | None = None,
    num_sms: int | None = None,
    block_n: int = 64,
    max_splits: int = 16,
) -> int:
    """Split-K factor for decode, from shapes only (plus an optional host-side max context length).

    Aim for about two programs per SM: with few (sequence, kv head) pairs, each context is split so
    the GPU fills up; with many, one split (no reduce pass). Never more splits than BLOCK_N tiles of
    the longest context when that is known. Does not read device memory, so it is CUDA-graph safe.
    """
    if num_sms is None:
        num_sms = 132
        if torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    programs = max(1, batch_size * num_kv_heads)
    splits = min(max_splits, max(1, math.ceil(2 * num_sms / programs)))
    if max_seq_len is not None:
        splits = min(splits, max(1, math.ceil(max_seq_len / block_n)))
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, h, d], attending to its whole context of seq_lens[b] tokens.

    num_splits=None picks a split-K factor from the shapes (see `choose_num_splits`); 1 skips the
    reduce pass. A sequence with seq_len 0 (a CUDA-graph padding row) gets zeros.
    """
    _check_cache(key_cache, value_cache)
    B, H, D = q.shape
    _, block_size, kvh, d_cache = key_cache.shape
    if d_cache != D or H % kvh != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(key_cache.shape)}")
    group = H // kvh
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    q = _heads_contiguous(q)
    if num_splits is None:
        num_splits = choose_num_splits(B, kvh, max_seq_len, block_n=block_n)
    num_splits = max(1, int(num_splits))
    block_d = max(16, _next_pow2(D))
    g_pad = max(16, _next_pow2(group))  # tl.dot needs >= 16 rows
    kernels = _kernels()
    if num_splits > 1:
        mid_o = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any tensor will do
        mid_o = out
        mid_lse = out
    kernels["decode_split"][(B, kvh, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        block_size, D, group,
        G_PAD=g_pad, BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=_dot_precision(q.dtype),
    )
    if num_splits > 1:
        kernels["decode_reduce"][(B, H)](
            mid_o, mid_lse, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            D,
            NUM_SPLITS=num_splits, S_PAD=_next_pow2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for q [T, h, d]: sequence s's queries are rows query_start_loc[s]:[s+1] and
    are the last q_len_s positions of its context of seq_lens[s] tokens (chunked prefill: earlier
    positions are already in the cache). K/V for every position, new ones included, are read from
    the paged cache, so store_kv must have run first.

    block_m is the number of (token, query head) rows per program; the query heads of one kv head
    share a program, so a tile holds block_m // group tokens.
    """
    _check_cache(key_cache, value_cache)
    T, H, D = q.shape
    _, block_size, kvh, d_cache = key_cache.shape
    if d_cache != D or H % kvh != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(key_cache.shape)}")
    group = H // kvh
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, expected {B + 1}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    q = _heads_contiguous(q)
    g_pad = _next_pow2(group)
    block_q = max(1, _next_pow2(block_m) // g_pad)
    while block_q * g_pad < 16:  # tl.dot needs >= 16 rows
        block_q *= 2
    grid = (triton_cdiv(T, block_q) + B, kvh)
    _kernels()["prefill"][grid](
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E,
        B,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        block_size, D, group,
        BLOCK_Q=block_q, G_PAD=g_pad, BLOCK_D=max(16, _next_pow2(D)), BLOCK_N=block_n,
        PRECISION=_dot_precision(q.dtype),
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
