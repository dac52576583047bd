"""Quantized linears against a reference dequantize-then-matmul written from each format's definition.

Tolerances: the kernels sum float32 products of the same values in another order than the
reference's matmul, so outputs agree to float32 rounding of the sums: |Δ| ≤ 1e-5 · Σ|x·w| per
output (K ≤ 1536 terms); w8a8's integer sums are exact, only its final float scalings round.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.quant import cpu_kernels, grouped
from pagedserve.quant.grouped import GroupedLinear, GroupedWeight, pack_nibbles


def _close(got, x, w, bias=None):
    want = x @ w.t() + (bias if bias is not None else 0)
    bound = 1e-5 * ((x.abs() @ w.abs().t()) + 1e-3)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


def _reference_4bit(ints, scales, offsets, group):
    """W[n, k] = q[n, k] · s[n, k // g] + m[n, k // g], from unpacked integers (the layout's definition)."""
    cols = torch.arange(ints.shape[1]) // group
    return ints.float() * scales[:, cols] + (offsets[:, cols] if offsets is not None else 0)


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip(f"native quant kernels unavailable: {cpu_kernels.failure_reason()}")
    return request.param


@pytest.mark.parametrize("bits,group,with_offsets", [(4, 32, True), (4, 64, False), (8, 32, False), (8, 16, True),
                                                     (8, 96, True)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, grouped.DIRECT_MAX_ROWS + 5])
def test_grouped_linear_matches_dequantized_reference(kernel, bits, group, with_offsets, rows):
    g = torch.Generator().manual_seed(bits * 1000 + group + rows)
    n, k = 40, 192
    if bits == 4:
        ints = torch.randint(0, 16, (n, k), generator=g)
        q = pack_nibbles(ints)
    else:
        ints = torch.randint(-128, 128, (n, k), generator=g)
        q = ints.to(torch.int8)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.1
    offsets = torch.randn(n, groups, generator=g) * 0.2 if with_offsets else None
    wq = GroupedWeight(q, scales, offsets, bits, group, k)
    ref = _reference_4bit(ints, scales, offsets, group)
    torch.testing.assert_close(wq.dequantize(), ref, rtol=0, atol=1e-6)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    _close(GroupedLinear(wq, bias, "t")(x), x, ref, bias)
    # bfloat16 activations are widened, computed in float32 and the output rounded once
    xb = x.bfloat16()
    out = GroupedLinear(wq, None, "t")(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), xb.float() @ ref.t(), rtol=1e-2, atol=1e-2)


def test_act_order_permutation_reads_permuted_columns(kernel):
    g = torch.Generator().manual_seed(7)
    n, k = 16, 64
    ints = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, 2, generator=g)
    perm = torch.randperm(k, generator=g)
    wq = GroupedWeight(pack_nibbles(ints), scales, None, 4, 32, k, perm)
    x = torch.randn(2, k, generator=g)
    _close(GroupedLinear(wq, None, "t")(x), x[:, perm], _reference_4bit(ints, scales, None, 32))


def test_stack_fuses_along_outputs_and_refuses_mixed_layouts():
    a = GroupedWeight(torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1), None, 8, 32, 32)
    b = GroupedWeight(torch.ones(4, 32, dtype=torch.int8), torch.ones(4, 1), None, 8, 32, 32)
    s = GroupedWeight.stack([a, b])
    assert s.out_features == 12 and torch.equal(s.dequantize()[8:], torch.ones(4, 32))
    c = GroupedWeight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2), None, 8, 16, 32)
    with pytest.raises(ValueError):
        GroupedWeight.stack([a, c])
    with pytest.raises(ValueError, match="do not match"):
        GroupedWeight(torch.zeros(8, 30, dtype=torch.int8), torch.ones(8, 1), None, 8, 32, 32)


def test_int8_per_channel_error_is_half_a_step(kernel):
    from pagedserve.quant.int8 import quantize_per_channel

    w = torch.randn(24, 96) * torch.linspace(0.01, 3, 24)[:, None]
    q = quantize_per_channel(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(5, 96)
    _close(GroupedLinear(q, None, "int8")(x), x, q.dequantize())


def test_w8a8_matches_integer_reference(kernel):
    from pagedserve.quant.int8 import W8A8Linear, quantize_per_channel, quantize_rows, w8a8_reference

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 100, generator=g)
    q = quantize_per_channel(w)
    x = torch.randn(6, 100, generator=g)
    bias = torch.randn(48, generator=g)
    got = W8A8Linear(q, bias, "w8a8")(x)
    # written from the definition: per-token int8 activations, exact int32 sums, two scales
    xq, xs = quantize_rows(x)
    ints = (xq.to(torch.int64) @ q.q.to(torch.int64).t()).to(torch.float64)
    want = (ints * xs.double() * q.scales[:, 0].double()).float() + bias
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w8a8_reference(x, q, bias), want, rtol=1e-6, atol=1e-5)
    # and within the two roundings of the float product
    dense = x @ w.t() + bias
    assert (got - dense).abs().max() <= 0.02 * (x.abs() @ w.abs().t()).max()


# ------------------------------------------------------------------------------------------------
# GGUF blocks: our layout against gguf-py's own dequantization (ggml's reference decoder)

def _random_blocks(type_name: str, rows: int, nblocks: int, seed: int) -> np.ndarray:
    """Random bytes for each block, with its float16 fields set to sane scales (no NaN/inf)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, nblocks, size), dtype=np.uint8)
    f16_at = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[type_name]
    for off in f16_at:
        raw[..., off:off + 2] = rng.uniform(0.001, 0.05, size=(rows, nblocks)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, nblocks * size)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_decode_as_ggml_does(kernel, type_name):
    import gguf
    from gguf.quants import dequantize

    from pagedserve.quant.gguf import grouped_from_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    block_w, _ = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = 512 // block_w
    raw = _random_blocks(type_name, 8, nblocks, seed=len(type_name) + block_w)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(8, 512).astype(np.float32))
    w = grouped_from_blocks("blk.0.ffn_up.weight", type_name, raw)
    torch.testing.assert_close(w.dequantize(), want, rtol=1e-6, atol=1e-6)
    assert w.nbytes < want.numel() * 4 / 2.5  # stays quantized
    x = torch.randn(3, 512)
    _close(GroupedLinear(w, None, "gguf")(x), x, want)


def test_gguf_corrupt_block_row_names_the_tensor():
    from pagedserve.quant.builder import TensorError
    from pagedserve.quant.gguf import grouped_from_blocks

    with pytest.raises(TensorError, match="blk.3.attn_q.weight.*whole number of Q4_1 blocks"):
        grouped_from_blocks("blk.3.attn_q.weight", "Q4_1", np.zeros((4, 41), np.uint8))
