"""The fused CPU element-wise ops against the torch ops they replace, and the engine with and
without them."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import fused_ops as cpu_fused
from pagedserve.model.llama import RMSNorm
from pagedserve.model.rope import RotaryEmbedding
from hf_reference import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(cpu_fused.load() is None, reason="fused CPU ops could not be built here")


@pytest.mark.parametrize("hidden", [512, 520, 100, 7])
def test_rms_norm_with_and_without_residual_add(hidden):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    x = torch.randn(37, hidden, generator=g) * 3
    res = torch.randn(37, hidden, generator=g)
    assert torch.allclose(norm.fused(x), norm(x), rtol=1e-5, atol=1e-6)
    want_sum = res + x
    want = norm(want_sum)
    got = norm.fused(x, res)
    assert torch.equal(res, want_sum)  # the residual add is done in place, rounded as torch rounds it
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul_matches_torch(inter):
    gu = torch.randn(300, 2 * inter, generator=torch.Generator().manual_seed(1)) * 6
    gate, up = gu.split(inter, dim=-1)
    assert torch.allclose(cpu_fused.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


# head sizes: scalar only (16: 8 rotated pairs), vector + scalar tail (40), whole vectors (64, 128)
@pytest.mark.parametrize("d", [16, 40, 64, 128])
def test_rope_writes_the_cache_bit_for_bit_as_the_torch_path(d):
    g = torch.Generator().manual_seed(2)
    t, h, kvh, slots = 9, 4, 2, 40
    rope = RotaryEmbedding(d, 128, 10000.0, None)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    positions = torch.tensor([0, 1, 2, 50, 51, 127, 3, 4, 5])
    slot_mapping = torch.randperm(slots, generator=g)[:t]
    k_cache = torch.full((slots, kvh, d), 7.0)
    v_cache = torch.full((slots, kvh, d), 7.0)
    q = cpu_fused.rope_qkv(qkv, positions, rope.cos, rope.sin, slot_mapping, k_cache, v_cache, h, kvh, d)
    q_ref, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q_want, k_want = rope(positions, q_ref.reshape(t, h, d), k.reshape(t, kvh, d))
    assert torch.equal(q, q_want)
    assert torch.equal(k_cache[slot_mapping], k_want)
    assert torch.equal(v_cache[slot_mapping], v.reshape(t, kvh, d))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert (k_cache[untouched] == 7).all() and (v_cache[untouched] == 7).all()


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart a and b are (same-sign values; for the tests below)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


# bfloat16: every op rounds where torch's bfloat16 op would, so the results are torch's own bits,
# except where the sum of squares (summed in another order) or our exp differ in the last bit
# before a rounding: then one bfloat16 step, rarely.
@pytest.mark.parametrize("hidden", [512, 520, 100, 7])
def test_rms_norm_bf16_rounds_as_torch(hidden):
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(hidden, 1e-5, dtype=torch.bfloat16)
    norm.weight.data = torch.randn(hidden, generator=g).bfloat16()
    x = (torch.randn(41, hidden, generator=g) * 3).bfloat16()
    res = torch.randn(41, hidden, generator=g).bfloat16()
    got, want = norm.fused(x), norm(x)
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, want).max() <= 1
    assert (got == want).float().mean() > 0.99
    want_sum = res + x
    got = norm.fused(x, res)
    assert torch.equal(res, want_sum)
    assert _bf16_ulps(got, norm(want_sum)).max() <= 1 and (got == norm(want_sum)).float().mean() > 0.99


@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul_bf16_rounds_as_torch(inter):
    gu = (torch.randn(300, 2 * inter, generator=torch.Generator().manual_seed(5)) * 6).bfloat16()
    gate, up = gu.split(inter, dim=-1)
    got, want = cpu_fused.silu_mul(gu), F.silu(gate) * up
    assert got.dtype == torch.bfloat16
    assert _bf16_ulps(got, want).max() <= 1 and (got == want).float().mean() > 0.99


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


@pytest.mark.parametrize("d", [64, 40, 96])
def test_rope_bf16_writes_the_cache_bit_for_bit_as_the_torch_path(d):
    g = torch.Generator().manual_seed(6)
    t, h, kvh, slots = 11, 4, 2, 40
    rope = RotaryEmbedding(d, 2048, 10000.0, None)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).bfloat16()
    # signed zeros: cos < 0 < sin at positions 2 and 50 make -0 outputs that the bits below must keep
    qkv[2:4] = 0.0
    qkv[0, d:3 * d] = -0.0
    positions = torch.tensor([0, 1, 2, 50, 51, 127, 3, 4, 5, 1000, 2047])
    slot_mapping = torch.randperm(slots, generator=g)[:t]
    k_cache = torch.zeros((slots, kvh, d), dtype=torch.bfloat16)
    v_cache = torch.zeros((slots, kvh, d), dtype=torch.bfloat16)
    q = cpu_fused.rope_qkv(qkv, positions, rope.cos, rope.sin, slot_mapping, k_cache, v_cache, h, kvh, d)
    q_ref, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q_want, k_want = rope(positions, q_ref.reshape(t, h, d), k.reshape(t, kvh, d))
    assert q.dtype == torch.bfloat16 and torch.equal(_bits(q), _bits(q_want.contiguous()))
    assert torch.equal(_bits(k_cache[slot_mapping]), _bits(k_want.contiguous()))
    assert torch.equal(_bits(v_cache[slot_mapping]), _bits(v.reshape(t, kvh, d).contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_first_on_ties_and_nan_largest(dtype):
    x = torch.randn(6, 1003, generator=torch.Generator().manual_seed(3))
    x[1, 10] = x[1, 900] = 50.0  # tie: the first wins
    x[2, 1002] = 60.0  # in the scalar tail
    x[3, 5] = float("nan")
    x[3, 7] = 80.0
    x[4] = float("-inf")
    x[5, 600] = x[5, 601] = 70.0  # a tie inside one vector
    x = x.to(dtype)
    assert cpu_fused.argmax(x).tolist() == x.float().argmax(dim=-1).tolist()
    assert cpu_fused.argmax(x).tolist()[1:4] == [10, 1002, 5]
    assert cpu_fused.argmax(x).tolist()[5] == 600
    short = torch.randn(3, 5).to(dtype)  # rows shorter than a vector
    assert torch.equal(cpu_fused.argmax(short), short.float().argmax(dim=-1))


def test_greedy_bf16_tokens_same_whether_or_not_logits_are_widened(llama_dir):
    """A greedy batch that asks for nothing else takes the argmax of the bfloat16 LM head output
    as it is; asking for logprobs widens the logits to float32 first. Same tokens either way."""
    prompts = random_prompts(6, 300, [5, 40, 17], seed=11)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(model=str(llama_dir), dtype="bfloat16", num_gpu_blocks_override=256)
    plain = llm.generate(reqs, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    with_lp = llm.generate(reqs, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in with_lp]
    assert all(len(o.outputs[0].token_ids) == 10 for o in plain)


def test_engine_greedy_same_with_and_without_fused_ops(llama_dir, monkeypatch):
    prompts = random_prompts(5, 300, [3, 33, 90], seed=5)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fused = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    a = fused.generate(reqs, sp)
    monkeypatch.setattr(cpu_fused, "usable", lambda x: False)
    b = LLM(model=str(llama_dir), num_gpu_blocks_override=256).generate(reqs, sp)
    for p, x, y in zip(prompts, a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 8)


def test_engine_bf16_close_with_and_without_fused_ops(llama_dir, monkeypatch):
    # bfloat16 engines round differently wherever an op's order differs, so greedy paths may part
    # on a near-tie; the first token's logprobs (same prompt, same weights) must agree closely
    prompts = random_prompts(4, 300, [3, 33, 90, 150], seed=7)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    fused = LLM(model=str(llama_dir), dtype="bfloat16", num_gpu_blocks_override=256)
    assert cpu_fused.usable(torch.zeros(1, dtype=torch.bfloat16))
    a = fused.generate(reqs, sp)
    monkeypatch.setattr(cpu_fused, "usable", lambda x: False)
    b = LLM(model=str(llama_dir), dtype="bfloat16", num_gpu_blocks_override=256).generate(reqs, sp)
    for x, y in zip(a, b):
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        for tok in set(lx) & set(ly):
            assert abs(lx[tok].logprob - ly[tok].logprob) < 0.1
        assert len(set(lx) & set(ly)) >= 3
