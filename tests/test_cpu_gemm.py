"""The native float32 CPU GEMM against torch's linear, on the shapes that exercise its edges, and
the engine greedy-identical to transformers with it, with oneDNN and with plain torch linears."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.model import cpu_gemm
from pagedserve.model.cpu_linear import pack_linears
from hf_reference import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not cpu_gemm.usable(), reason="native GEMM needs a C++ compiler and an AVX2/FMA CPU")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# rows: within one 6-row tile, across tiles, across the 1020-row block; K: shorter than the
# 4-step unroll, odd, one k block, cut into blocks (> 768); N: inside one 16-column panel, one
# panel plus a remainder, fewer panels than threads
@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 1031])
@pytest.mark.parametrize("k,n", [(1, 16), (3, 17), (37, 40), (512, 1), (800, 33), (1537, 48)])
def test_linear_matches_torch(threads, m, k, n):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    packed = cpu_gemm.pack_weight(w)
    tol = dict(rtol=1e-4, atol=1e-4 * k ** 0.5)
    assert torch.allclose(cpu_gemm.linear(x, packed, n), x @ w.T, **tol)
    assert torch.allclose(cpu_gemm.linear(x, packed, n, b), F.linear(x, w, b), **tol)


def test_strided_and_batched_inputs(threads):
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(96, 50)
    native = cpu_gemm.NativeLinear(layer)
    wide = torch.randn(2, 9, 200, generator=g)
    x = wide[..., 10:106]  # rows 200 floats apart, not contiguous
    assert native(x).shape == (2, 9, 50)
    assert torch.allclose(native(x), layer(x), rtol=1e-4, atol=1e-4)
    assert native(torch.empty(0, 96)).shape == (0, 50)
    one = torch.randn(96, generator=g).expand(4, 96)  # stride 0 between rows
    assert torch.allclose(native(one), layer(one), rtol=1e-4, atol=1e-4)


def test_pack_linears_swaps_every_float32_linear():
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Sequential(nn.Linear(48, 16, bias=False)))
    x = torch.randn(5, 64)
    want = model(x)
    n, path = pack_linears(model, batch_hint=8)
    assert (n, path) == (2, "native GEMM")
    assert isinstance(model[0], cpu_gemm.NativeLinear) and isinstance(model[2][0], cpu_gemm.NativeLinear)
    assert torch.allclose(model(x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gemm", ["native", "onednn", "torch"])
def test_engine_greedy_matches_transformers_on_each_linear_path(llama_dir, monkeypatch, gemm):
    if gemm == "torch":
        monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    else:
        monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", gemm)
    prompts = random_prompts(4, 300, [5, 40, 130], seed=11)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    linears = {type(m).__name__ for m in llm.llm_engine.runner.model.modules() if "Linear" in type(m).__name__}
    assert linears == {"native": {"NativeLinear"}, "onednn": {"PackedLinear"}, "torch": {"Linear"}}[gemm]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, o in zip(prompts, out):
        assert o.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 8)
