"""The native CPU GEMM against torch's linear, on the shapes that exercise its edges (float32, and
bfloat16 weights widened in the kernel), on each tile this CPU runs (AVX2, and AVX-512 where it
has it), and the engine greedy-identical to transformers with it, with oneDNN and with plain
torch linears; in bfloat16, close to transformers bfloat16."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.runner.cpu_packing import PackedLinear, pack_linears
from hf_reference import hf_greedy, hf_logprobs, random_prompts

pytestmark = pytest.mark.skipif(not cpu_gemm.usable(), reason="native GEMM needs a C++ compiler and an AVX2/FMA CPU")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


_AVX512 = cpu_gemm.vector_bits() == 512


_DOT = cpu_gemm.bf16_k_pairs() and cpu_gemm.set_bf16_dot(True)  # this CPU has AVX512-BF16
cpu_gemm.set_bf16_dot(None)


@pytest.fixture(params=["dot", "widen", "avx2"])
def bf16_tile(request):
    """Runs bfloat16 GEMMs on one tile: vdpbf16ps or widening AVX-512 over k-pair panels, or
    the AVX2 tile over interleaved ones; yields the k_pairs layout it takes."""
    if request.param != "avx2" and not _AVX512:
        pytest.skip("this CPU has no AVX-512")
    if request.param == "dot" and not _DOT:
        pytest.skip("this CPU has no AVX512-BF16")
    cpu_gemm.set_bf16_dot(request.param == "dot")
    yield request.param != "avx2"
    cpu_gemm.set_bf16_dot(None)


@pytest.fixture(params=["avx512", "avx2"])
def tile(request):
    """Runs float32 GEMMs on one tile, and packs bfloat16 weights for it (k_pairs)."""
    if request.param == "avx512" and not _AVX512:
        pytest.skip("this CPU has no AVX-512")
    cpu_gemm.set_avx512(request.param == "avx512")
    yield request.param == "avx512"
    cpu_gemm.set_avx512(True)


# rows: within one tile (6 rows AVX2, 8 AVX-512), across tiles, across the 510/512-row blocks; K:
# 1, odd (bfloat16 k pairs pad it), one k block, cut into blocks (> 1100; the AVX2 tile takes
# up to ~3000 in one where L2 is 512 KB, so 6000 cuts it there too); N: inside one
# 16-column panel, 2 and 3 panels side by side (the AVX-512 tile's widths), several tiles of 3
# plus a remainder, fewer panels than threads
@pytest.mark.parametrize("m", [1, 5, 6, 7, 9, 64, 1031])
@pytest.mark.parametrize("k,n", [(1, 16), (3, 17), (37, 40), (512, 1), (5, 130), (64, 100), (1101, 33), (2300, 48), (6000, 20)])
def test_linear_matches_torch(threads, tile, m, k, n):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    packed = cpu_gemm.pack_weight(w)
    tol = dict(rtol=1e-4, atol=1e-4 * k ** 0.5)
    assert torch.allclose(cpu_gemm.linear(x, packed), x @ w.T, **tol)
    assert torch.allclose(cpu_gemm.linear(x, packed, b), F.linear(x, w, b), **tol)


# N of at least 256 columns per thread: with 2 threads each packs its own copy of the x block
# (float32 weights at any row count, bfloat16 weights from 512-row blocks), with 1 the one copy.
# Which thread computes an output does not change its sums, so both give the same bits, across
# 512-row blocks and (float32, K = 2300) k blocks.
@pytest.mark.parametrize("m", [9, 300, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_private_x_blocks_give_the_same_bits_as_one_thread(tile, dtype, m):
    g = torch.Generator().manual_seed(m)
    k, n = 2300, 520
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = cpu_gemm.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, packed)
        torch.set_num_threads(2)
        two = cpu_gemm.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    exact = _float32_sums(x.float(), w.float())
    assert ((one.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-4 * k ** 0.5).all()


def _float32_sums(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


# bfloat16 weights: same edges. The kernel widens the weights exactly and sums in float32, then
# rounds once to bfloat16: each output is within one bfloat16 rounding (2^-9 relative) of the
# exact sum, plus float32 summation error. A wrongly interleaved column or lane is off by O(1).
# The AVX-512 bfloat16 tiles take K in one block as far as half of L2 allows (4096 at 1 MB, 8192
# at 2 MB) and store bfloat16 straight from the tiles there; 9000 is cut into blocks.
@pytest.mark.parametrize("m", [1, 7, 9, 64, 1031])
@pytest.mark.parametrize("k,n", [(1, 16), (3, 17), (37, 40), (5, 130), (1101, 33), (2300, 48), (9000, 20)])
def test_bf16_linear_is_float32_sums_rounded_once(threads, bf16_tile, m, k, n):
    tile = bf16_tile
    g = torch.Generator().manual_seed(m * 5 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = cpu_gemm.pack_weight(w, k_pairs=tile)
    assert packed.dtype == torch.bfloat16 and packed.k_pairs == tile
    for bias in (None, b.float()):
        out = cpu_gemm.linear(x, packed, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        exact = _float32_sums(x, w, bias)
        err = (out.double() - exact).abs()
        assert (err <= exact.abs() * 2 ** -8 + 1e-5 * k ** 0.5).all(), err.max()
        # most outputs are the exact sum's own bfloat16 rounding
        assert (out == exact.to(torch.bfloat16)).float().mean() > 0.97
    # float32 activations against the same bfloat16 panels
    x32 = torch.randn(m, k, generator=g)
    err = (cpu_gemm.linear(x32, packed).double() - _float32_sums(x32, w)).abs()
    assert (err <= _float32_sums(x32, w).abs() * 2 ** -8 + 1e-5 * k ** 0.5).all()


# The gate/up projection whose tiles store silu(gate) · up: bit for bit the GEMM followed by the
# fused ops' silu_mul, on every tile, across tiles, row blocks and 3-panel tile widths; its plain
# forward still returns [gate | up] in order. I = 8: one panel; 40: a partial 3-panel tile.
@pytest.mark.parametrize("m", [1, 7, 64, 600])
@pytest.mark.parametrize("i,k", [(8, 24), (40, 37), (1536, 512), (72, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_silu_epilogue_is_gemm_then_silu_mul(threads, tile, dtype, m, i, k):
    from pagedserve.kernels.cpu import fused_ops as cpu_fused
    if cpu_fused.load() is None:
        pytest.skip(f"fused ops unavailable: {cpu_fused.failure_reason()}")
    g = torch.Generator().manual_seed(m + i + k)
    layer = nn.Linear(k, 2 * i, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2 * i, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    fused, plain = cpu_gemm.NativeGateUp(layer), cpu_gemm.NativeLinear(layer)
    got = fused.silu_mul(x)
    assert got.dtype == dtype and got.shape == (m, i)
    assert torch.equal(got, cpu_fused.silu_mul(plain(x)))
    assert torch.equal(fused(x), plain(x))
    gate, up = F.linear(x.double(), layer.weight.double()).split(i, dim=-1)
    assert torch.allclose(got.double(), F.silu(gate) * up, rtol=2e-2, atol=1e-3 * k ** 0.5)


def test_gate_up_epilogue_refuses_shapes_it_cannot_store():
    for layer in (nn.Linear(64, 2 * 12, bias=False), nn.Linear(64, 32), nn.Linear(1101, 32, bias=False)):
        with pytest.raises(ValueError):
            cpu_gemm.NativeGateUp(layer)


def test_pack_linears_gives_the_mlp_its_silu_epilogue():
    from transformers import LlamaConfig

    from pagedserve.kernels.cpu.fused_ops import silu_mul
    from pagedserve.model.llama import MLP
    from pagedserve.model.spec import ModelSpec
    spec = ModelSpec.from_hf_config(LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                num_key_value_heads=2, num_hidden_layers=1, vocab_size=100))
    mlp = MLP(spec)
    x = torch.randn(9, spec.hidden_size)
    want = mlp.down_proj(silu_mul(mlp.gate_up_proj(x)))
    n, _ = pack_linears(mlp, batch_hint=8)
    assert n == 2 and isinstance(mlp.gate_up_proj, cpu_gemm.NativeGateUp)
    assert torch.allclose(mlp(x), want, rtol=1e-4, atol=1e-5)


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


def test_pack_linears_sends_bf16_linears_to_onednn_with_amx_and_native_gemm_without(monkeypatch):
    def model_and_input():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.SiLU(), nn.Linear(48, 16, bias=False)).bfloat16()
        return model, torch.randn(5, 64).bfloat16()

    model, x = model_and_input()
    want = model(x).float()
    monkeypatch.setattr(cpu_gemm, "amx", lambda: True)  # oneDNN's AMX bf16 GEMM is the faster one there
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert pack_linears(model, batch_hint=8) == (2, "oneDNN")
        assert all(isinstance(model[i], PackedLinear) for i in (0, 2))
        got = model(x)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    else:  # oneDNN refuses bfloat16 on this CPU: the layers stay torch's, not the native GEMM's
        assert pack_linears(model, batch_hint=8)[0] == 0
    model, x = model_and_input()
    monkeypatch.setattr(cpu_gemm, "amx", lambda: False)
    assert pack_linears(model, batch_hint=8) == (2, "native GEMM")
    assert isinstance(model[0], cpu_gemm.NativeLinear) and model[0].packed.dtype == torch.bfloat16
    got = model(x)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)


def test_pack_linears_mixes_paths_by_dtype(monkeypatch):
    # a float32 head on a bfloat16 body (or the reverse) takes each dtype's own best path
    monkeypatch.setattr(cpu_gemm, "amx", lambda: True)
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN takes no bfloat16 on this CPU")
    model = nn.Sequential(nn.Linear(32, 24).bfloat16(), nn.Linear(24, 8))
    n, path = pack_linears(model, batch_hint=4)
    assert n == 2 and path == "oneDNN + native GEMM"
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], cpu_gemm.NativeLinear)


@pytest.fixture
def restore_avx512():
    yield
    cpu_gemm.set_avx512(True)  # PAGEDSERVE_CPU_GEMM=avx2 switches the float32 tile for the process
    cpu_gemm.set_bf16_dot(None)


@pytest.mark.parametrize("gemm", ["native", "avx2", "onednn", "torch"])
def test_engine_greedy_matches_transformers_on_each_linear_path(llama_dir, monkeypatch, restore_avx512, gemm):
    if gemm == "avx2" and not _AVX512:
        pytest.skip("the same as native on a CPU without AVX-512")
    if gemm == "torch":
        monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    else:
        monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", gemm)
    prompts = random_prompts(4, 300, [5, 40, 130], seed=11)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    linears = {type(m).__name__ for m in llm.llm_engine.runner.model.modules() if "Linear" in type(m).__name__}
    want = {"native": {"NativeLinear"}, "avx2": {"NativeLinear"}, "onednn": {"PackedLinear"}, "torch": {"Linear"}}
    assert linears == want[gemm]
    if gemm in ("native", "avx2"):
        assert cpu_gemm.vector_bits() == (512 if gemm == "native" and _AVX512 else 256)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, o in zip(prompts, out):
        assert o.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 8)


@pytest.mark.parametrize("gemm", ["dot", "widen", "avx2", "onednn"])
def test_engine_bf16_on_each_gemm_tracks_transformers_bf16(llama_dir, monkeypatch, restore_avx512, gemm):
    # bfloat16 rounds differently in every engine, so greedy paths of a random-weight model (flat
    # logits, many near-ties) may part; what must hold is that every token we pick is one
    # transformers bfloat16 also rates (near-)top, with about the logprob it gives it.
    if gemm != "avx2" and not _AVX512:
        pytest.skip("the same as avx2 on a CPU without AVX-512")
    if gemm == "dot" and not _DOT:
        pytest.skip("the same as widen on a CPU without AVX512-BF16")
    if gemm == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN takes no bfloat16 on this CPU")
    if gemm != "onednn":
        assert cpu_gemm.set_bf16_dot(gemm == "dot") == (gemm == "dot")
    # with AMX (real or not) bf16 layers go to oneDNN prepacked, without it to the native GEMM
    monkeypatch.setattr(cpu_gemm, "amx", lambda: gemm == "onednn")
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "avx2" if gemm == "avx2" else "native")
    prompts = random_prompts(3, 300, [6, 45, 120], seed=5)
    llm = LLM(model=str(llama_dir), dtype="bfloat16", num_gpu_blocks_override=256)
    modules = list(llm.llm_engine.runner.model.modules())
    if gemm == "onednn":
        assert not any(isinstance(m, (nn.Linear, cpu_gemm.NativeLinear)) for m in modules)
        assert any(isinstance(m, PackedLinear) for m in modules)
    else:
        natives = [m for m in modules if isinstance(m, cpu_gemm.NativeLinear)]
        assert natives and all(m.packed.dtype == torch.bfloat16 and m.packed.k_pairs == (gemm != "avx2")
                               for m in natives)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp)):
        ids = o.outputs[0].token_ids
        ref = hf_logprobs(str(llama_dir), p + ids, dtype="bfloat16")[len(p) - 1:-1]
        for step, tok in enumerate(ids):
            ours = o.outputs[0].logprobs[step][tok].logprob
            assert ref[step, tok] >= ref[step].max() - 0.15, (step, tok)
            assert abs(ours - ref[step, tok].item()) < 0.15, (step, ours, ref[step, tok].item())


def test_the_bfloat16_dot_tile_is_chosen_by_cpuid_not_by_timing():
    """vdpbf16ps runs where CPUID says AVX512-BF16 on an AMD core (Zen 4 and later), the same way on
    every start, however busy the host is; a forced choice goes back to that rule."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    want = _DOT and "AuthenticAMD" in info
    assert cpu_gemm.bf16_dot() == (cpu_gemm.bf16_k_pairs() and want)
    cpu_gemm.set_bf16_dot(not want)
    assert cpu_gemm.set_bf16_dot(None) == (cpu_gemm.bf16_k_pairs() and want)


def test_a_shape_the_library_refuses_is_a_python_error_not_an_abort():
    lib = cpu_gemm._native.load()
    # 15 output columns: not gate/up halves; the library returns before touching a pointer
    status = lib.gemm_f32_silu_mul(None, 0, 1, 64, None, 15, None, 0, 1)
    assert status < 0
    with pytest.raises(RuntimeError, match="does not take K=64"):
        cpu_gemm.check(status, "gemm_f32_silu_mul", 64)
    assert lib.gemm_bf16kp_bf16out(None, 0, 1, 1 << 30, None, 16, None, None, 16, 1) < 0
