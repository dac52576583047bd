"""The Triton paged-attention kernels against a naive torch reference, run by Triton's CPU interpreter.

TRITON_INTERPRET is read when a kernel is decorated with @triton.jit, and pagedserve defines its
kernels lazily on first use, so setting it here (before any kernel is used) is enough even when other
test modules imported torch or triton first. Sizes are kept small: the interpreter runs each program
in Python.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.kernels.triton import paged_attention as tk  # noqa: E402

ATOL = 1e-4
RTOL = 1e-4


def _device():
    """cpu under the interpreter; cuda when run with TRITON_INTERPRET=0 on a GPU machine."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


DEV = _device()


@pytest.fixture(scope="module", autouse=True)
def _triton_ready():
    if not tk.triton_available():
        pytest.skip("triton is not installed (pip install triton): the Triton kernels cannot be tested")
    if DEV == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} and no GPU: the kernels cannot run")
    kind = type(tk._kernels()["store_kv"]).__name__
    if DEV == "cpu" and kind != "InterpretedFunction":
        pytest.fail(f"the kernels were built as {kind}, not for Triton's interpreter: something used them "
                    "before this module set TRITON_INTERPRET=1 (set it in the environment instead)")


# Tensors are made on the CPU (seeded generators) and moved to DEV for the kernels.


def store_kv(key, value, kc, vc, slots):
    kd, vd = kc.to(DEV), vc.to(DEV)
    tk.store_kv(key.to(DEV), value.to(DEV), kd, vd, slots.to(DEV))
    kc.copy_(kd.cpu())
    vc.copy_(vd.cpu())


def decode(q, kc, vc, bt, sl, *args, **kwargs):
    return tk.paged_decode_attention(*(t.to(DEV) for t in (q, kc, vc, bt, sl)), *args, **kwargs).cpu()


def prefill(q, kc, vc, bt, qsl, sl, *args, **kwargs):
    return tk.paged_prefill_attention(*(t.to(DEV) for t in (q, kc, vc, bt, qsl, sl)), *args, **kwargs).cpu()


# ---------------------------------------------------------------- reference


def ref_attention(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    """Naive: per sequence gather its context token by token through the block table, causal softmax."""
    T, H, D = q.shape
    block_size, kvh = key_cache.shape[1], key_cache.shape[2]
    group = H // kvh
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        L = int(seq_lens[s])
        ctx = L - (q1 - q0)
        pos = torch.arange(L)
        blocks = block_tables[s, pos // block_size].long()
        k = key_cache[blocks, pos % block_size].double()  # [L, kvh, D]
        v = value_cache[blocks, pos % block_size].double()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        qpos = ctx + torch.arange(q1 - q0)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, gen, extra_blocks=3, dtype=torch.float32):
    """Random caches and a shuffled (non-contiguous) block table covering every sequence."""
    need = [math.ceil(L / block_size) for L in seq_lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)  # -1: unused entries
    i = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[i : i + n].to(torch.int32)
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, dtype=dtype)
    return key_cache, value_cache, block_tables


# ---------------------------------------------------------------- store_kv


def test_store_kv_writes_slots_and_skips_minus_one():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kvh, d = 6, 16, 2, 64
    kc = torch.zeros(num_blocks, block_size, kvh, d)
    vc = torch.zeros_like(kc)
    T = 7
    key = torch.randn(T, kvh, d, generator=gen)
    value = torch.randn(T, kvh, d, generator=gen)
    slots = torch.tensor([5 * 16 + 3, 0, -1, 2 * 16 + 15, 17, -1, 4 * 16], dtype=torch.int64)
    store_kv(key, value, kc, vc, slots)
    ref_k = torch.zeros_like(kc)
    ref_v = torch.zeros_like(vc)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            ref_k[slot // block_size, slot % block_size] = key[t]
            ref_v[slot // block_size, slot % block_size] = value[t]
    torch.testing.assert_close(kc, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(vc, ref_v, atol=0, rtol=0)


def test_store_kv_strided_input_and_block_size_32():
    # key/value as views of a fused qkv projection output (non-contiguous over tokens)
    gen = torch.Generator().manual_seed(1)
    T, kvh, d, block_size = 5, 1, 128, 32
    qkv = torch.randn(T, 3, kvh, d, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    kc = torch.zeros(3, block_size, kvh, d)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([64, 65, 31, -1, 0], dtype=torch.int64)
    store_kv(key, value, kc, vc, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot // block_size, slot % block_size], key[t])
            assert torch.equal(vc[slot // block_size, slot % block_size], value[t])
    assert kc[0, 1:31].abs().sum() == 0


# ---------------------------------------------------------------- decode


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits)
    pytest.param(2, 2, 64, 16, [1, 17, 40], 1, id="mha-bs16-d64-nosplit"),
    pytest.param(4, 1, 64, 16, [33, 5, 70], 3, id="gqa4-bs16-d64-split3"),
    pytest.param(8, 1, 128, 32, [100, 31, 64], 4, id="gqa8-bs32-d128-split4"),
    pytest.param(4, 2, 128, 16, [130, 2], None, id="gqa2-bs16-d128-auto-split"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,num_splits", DECODE_CASES)
def test_paged_decode_attention(num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits):
    gen = torch.Generator().manual_seed(hash((num_heads, head_dim, block_size)) % 1000)
    kc, vc, bt = make_paged(seq_lens, num_kv_heads, head_dim, block_size, gen)
    B = len(seq_lens)
    q = torch.randn(B, num_heads, head_dim, generator=gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    out = decode(q, kc, vc, bt, sl, scale, num_splits=num_splits, block_n=16)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    ref = ref_attention(q, kc, vc, bt, qsl, sl, scale)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_decode_split_count_does_not_change_result_and_empty_splits():
    # more splits than tiles for the short sequences: some splits are empty and must weigh nothing
    gen = torch.Generator().manual_seed(7)
    seq_lens = [3, 90]
    kc, vc, bt = make_paged(seq_lens, 1, 64, 16, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ref = ref_attention(q, kc, vc, bt, torch.arange(3, dtype=torch.int32), sl, 0.125)
    for splits in (1, 2, 8):
        out = decode(q, kc, vc, bt, sl, 0.125, num_splits=splits, block_n=16)
        torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL, msg=f"num_splits={splits}")


def test_decode_default_scale_and_padding_row_zero_length():
    gen = torch.Generator().manual_seed(3)
    kc, vc, bt = make_paged([20, 1], 2, 64, 16, gen)
    q = torch.randn(2, 2, 64, generator=gen)
    sl = torch.tensor([20, 0], dtype=torch.int32)  # second row: a CUDA-graph padding entry
    for splits in (1, 2):
        out = decode(q, kc, vc, bt, sl, num_splits=splits, block_n=16)
        assert torch.isfinite(out).all()
        assert out[1].abs().sum() == 0
        ref = ref_attention(q[:1], kc, vc, bt[:1], torch.tensor([0, 1]), sl[:1], 1 / 8)
        torch.testing.assert_close(out[:1].double(), ref, atol=ATOL, rtol=RTOL)


def test_choose_num_splits_is_shape_only():
    assert tk.choose_num_splits(256, 8, num_sms=132) == 1
    assert tk.choose_num_splits(1, 1, num_sms=132) == 16
    assert tk.choose_num_splits(1, 8, num_sms=132) == min(16, math.ceil(264 / 8))
    assert tk.choose_num_splits(1, 1, max_seq_len=100, num_sms=132, block_n=64) == 2


# ---------------------------------------------------------------- prefill


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, q_lens, seq_lens)
    pytest.param(2, 2, 64, 16, [5, 20, 1], [5, 20, 1], id="mha-bs16-d64-plain"),
    pytest.param(4, 1, 64, 32, [9, 17], [9, 17], id="gqa4-bs32-d64-plain"),
    pytest.param(8, 1, 128, 16, [6, 12], [40, 12], id="gqa8-bs16-d128-chunked"),
    pytest.param(4, 2, 128, 32, [1, 10, 3], [50, 70, 3], id="gqa2-bs32-d128-chunked-mixed"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,q_lens,seq_lens", PREFILL_CASES)
def test_paged_prefill_attention(num_heads, num_kv_heads, head_dim, block_size, q_lens, seq_lens):
    gen = torch.Generator().manual_seed(sum(seq_lens))
    kc, vc, bt = make_paged(seq_lens, num_kv_heads, head_dim, block_size, gen)
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 0.3
    # small tiles so several q tiles and kv tiles (spanning pages) are exercised
    out = prefill(q, kc, vc, bt, qsl, sl, scale, block_m=16, block_n=16)
    ref = ref_attention(q, kc, vc, bt, qsl, sl, scale)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_store_then_prefill_then_decode_end_to_end():
    """A chunked prompt written with store_kv chunk by chunk, then one decode step; vs plain causal attention."""
    gen = torch.Generator().manual_seed(11)
    H, KVH, D, BS = 4, 1, 64, 16
    L = 37
    num_blocks = 8
    table = torch.tensor([[6, 1, 4, 0]], dtype=torch.int32)
    kc = torch.zeros(num_blocks, BS, KVH, D)
    vc = torch.zeros_like(kc)
    qs = torch.randn(L + 1, H, D, generator=gen)
    ks = torch.randn(L + 1, KVH, D, generator=gen)
    vs = torch.randn(L + 1, KVH, D, generator=gen)

    def slots(a, b):
        p = torch.arange(a, b)
        return (table[0, p // BS].long() * BS + p % BS).long()

    outs = []
    for a, b in ((0, 20), (20, L)):  # two prefill chunks
        store_kv(ks[a:b], vs[a:b], kc, vc, slots(a, b))
        qsl = torch.tensor([0, b - a], dtype=torch.int32)
        outs.append(prefill(qs[a:b], kc, vc, table, qsl, torch.tensor([b], dtype=torch.int32),
                                               block_m=16, block_n=16))
    store_kv(ks[L:], vs[L:], kc, vc, slots(L, L + 1))
    outs.append(decode(qs[L:], kc, vc, table, torch.tensor([L + 1], dtype=torch.int32),
                                          num_splits=2, block_n=16))
    got = torch.cat(outs)

    k = ks.repeat_interleave(H // KVH, 1).double()
    v = vs.repeat_interleave(H // KVH, 1).double()
    scores = torch.einsum("nhd,lhd->hnl", qs.double(), k) / math.sqrt(D)
    causal = torch.ones(L + 1, L + 1, dtype=torch.bool).tril()
    ref = torch.einsum("hnl,lhd->nhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)


def test_prefill_many_short_sequences_and_tile_aligned_lengths():
    # q_len == BLOCK_Q, 1-token sequences (decode rows through the prefill kernel), a zero-length query
    gen = torch.Generator().manual_seed(5)
    q_lens = [16, 1, 1, 0, 32, 3]
    seq_lens = [16, 9, 1, 4, 40, 3]
    kc, vc, bt = make_paged(seq_lens, 2, 64, 16, gen)
    q = torch.randn(sum(q_lens), 2, 64, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = prefill(q, kc, vc, bt, qsl, sl, 0.125, block_m=16, block_n=32)
    torch.testing.assert_close(out.double(), ref_attention(q, kc, vc, bt, qsl, sl, 0.125), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cache(dtype):
    if dtype == torch.bfloat16 and _device() == "cpu":
        pytest.skip(
            "Triton's interpreter does not support bfloat16 tl.dot: it keeps bf16 as uint16 and multiplies the "
            "raw bit patterns (triton-lang/triton#11584, 'we just don't support it yet'); runs on a GPU only"
        )
    gen = torch.Generator().manual_seed(9)
    seq_lens, q_lens = [30, 50], [30, 7]
    kc, vc, bt = make_paged(seq_lens, 1, 64, 16, gen, dtype=dtype)
    q = torch.randn(sum(q_lens), 4, 64, generator=gen).to(dtype)
    qsl = torch.tensor([0, 30, 37], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = prefill(q, kc, vc, bt, qsl, sl, 0.125, block_m=16, block_n=16)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), ref_attention(q, kc, vc, bt, qsl, sl, 0.125), atol=tol, rtol=tol)
    dec = decode(q[[29, 36]], kc, vc, bt, sl, 0.125, num_splits=2, block_n=16)
    torch.testing.assert_close(dec.double(), ref_attention(q[[29, 36]], kc, vc, bt, torch.arange(3), sl, 0.125),
                               atol=tol, rtol=tol)
