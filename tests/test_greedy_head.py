"""The screened greedy LM head (runner/greedy_head.py): its argmax is the float32 head's, bit for
bit and ties included, on every GEMM tile this CPU runs; its error bound holds; the engine uses it
only for steps that take nothing but argmaxes, and stays token-identical to transformers."""
import pytest
import torch
from torch import nn

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import fused_ops as cpu_fused, gemm as cpu_gemm
from pagedserve.runner import greedy_head

pytestmark = pytest.mark.skipif(not cpu_gemm.usable(), reason="native GEMM needs a C++ compiler and an AVX2/FMA CPU")

_AVX512 = cpu_gemm.vector_bits() == 512


@pytest.fixture(params=["avx512", "avx2"])
def tile(request):
    """Runs the float32 head (and packs the bfloat16 screen) for one tile."""
    if request.param == "avx512" and not _AVX512:
        pytest.skip("this CPU has no AVX-512")
    cpu_gemm.set_avx512(request.param == "avx512")
    yield request.param
    cpu_gemm.set_avx512(True)


_INT8 = cpu_gemm.usable() and bool(cpu_gemm._native.lib.greedy_screen_int8_takes(512))
_BF16_HEAD = _INT8 and cpu_gemm.bf16_k_pairs() and cpu_gemm.bf16_dot()  # a bfloat16 head on vdpbf16ps


@pytest.fixture(params=["int8", "bf16"])
def kind(request):
    if request.param == "int8" and not _INT8:
        pytest.skip("this CPU has no AVX512-VNNI")
    return request.param


def _head(n: int, k: int, seed: int) -> tuple[cpu_gemm.NativeLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
        lin.weight[n // 2] = lin.weight[3]  # an exact tie with row 3
        lin.weight[n - 1] = lin.weight[3] * (1 + 2 ** -22)  # a near tie, within the bfloat16 screen's error
    return cpu_gemm.NativeLinear(lin), lin.weight.detach()


# K: one k block, and 3001 (two blocks on both tiles: the sums' block order must be replayed)
@pytest.mark.parametrize("k", [64, 512, 3001])
@pytest.mark.parametrize("m", [1, 9, 300])
def test_argmax_matches_float32_head(tile, kind, m, k):
    n = 1000
    head, weight = _head(n, k, seed=m + k)
    screened = greedy_head.ScreenedGreedyHead(head, kind)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g) * 4
    x[0] = weight[3] * 300  # rows 3, n/2 and n-1 lead, tied or nearly
    if m > 2:
        x[1] = 0.0  # every logit 0: the first index wins
        x[2, 5] = float("nan")  # falls back to the plain head: NaN counts as the largest, as in torch.argmax
    want = cpu_fused.argmax(head(x))
    got = screened.argmax(x)
    assert got.tolist() == want.tolist()
    assert want[0] in (3, n // 2, n - 1)
    if m > 2:
        assert got[1] == 0 and got[2] == want[2]
    # the screen leaves few tokens to compute in float32 (an exact-zero row leaves all of them); the
    # bound grows as √K against the logits' spread, and the int8 one is ~3x the bfloat16 one
    per_row = {("bf16", True): 8, ("bf16", False): 50, ("int8", True): 40, ("int8", False): n}[kind, k <= 512]
    assert screened.computed <= n + m * per_row


def test_error_bound_holds_and_is_tight_enough(tile):
    """|bfloat16 screen − float32 logit| ≤ coef·‖h‖·‖W[v]‖ on every logit, and within 20× of the
    largest error seen (a bound far looser would leave many candidates to recompute)."""
    n, k = 4096, 512
    head, _ = _head(n, k, seed=1)
    screened = greedy_head.ScreenedGreedyHead(head, "bf16")
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 64)[:, None]
    exact = head(x)
    screen = cpu_gemm.linear(x.to(torch.bfloat16), screened.screen_weight, float32_out=True)
    bound = screened.coef * x.double().norm(dim=1)[:, None] * screened.w_norms.double()[None, :]
    err = (screen.double() - exact.double()).abs()
    assert (err <= bound).all()
    assert (err / bound).max() > 0.05


def test_bound_coef_grows_with_k():
    assert 0.0078 < greedy_head.bound_coef(512) < 0.0081
    assert greedy_head.bound_coef(8192) > greedy_head.bound_coef(512)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_engine_greedy_identical_with_screen(llama_dir, kind, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_GREEDY_SCREEN", kind)
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    head = llm.llm_engine.runner.greedy_head
    assert head.kind == kind
    prompts = random_prompts(12, llm.llm_engine.spec.vocab_size, [1, 5, 17, 33, 64, 100, 9, 130, 2, 48, 77, 20])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 10)
    assert head.rows == 12 * 10
    # a step with logprobs needs every logit: the plain head runs, the screen is not asked
    out = llm.generate({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=4, logprobs=2, **GREEDY))[0]
    assert head.rows == 12 * 10
    assert out.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(prompts[3]), 4)
    assert len(out.outputs[0].logprobs) == 4


def test_screen_off_and_bad_setting(llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_GREEDY_SCREEN", "0")
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64)
    assert llm.llm_engine.runner.greedy_head is None
    monkeypatch.setenv("PAGEDSERVE_GREEDY_SCREEN", "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_GREEDY_SCREEN"):
        LLM(model=str(llama_dir), num_gpu_blocks_override=64)


def test_int8_bound_formula_holds():
    """The int8 screen's bound (greedy_head's docstring, computed per row in the library) against
    the float32 logits, with the quantisation redone here in float64: every error within it."""
    n, k = 2048, 512
    head, w = _head(n, k, seed=3)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 32)[:, None]
    x[0, 7] = 40.0  # an outlier feature: a coarse row scale
    sw, qw, f = greedy_head._quantise_rows(w)
    sx, qx, e = greedy_head._quantise_rows(x)
    screen = (qx.double() @ qw.double().T) * sx.double()[:, None] * sw.double()[None, :]
    hq = sx.double()[:, None] * qx.double()
    g = greedy_head._gamma(k) + 4 * 2.0 ** -24
    bound = (hq.norm(dim=1)[:, None] * f[None, :] + (e + g * x.double().norm(dim=1))[:, None]
             * w.double().norm(dim=1)[None, :]) * 1.01
    err = (screen - head(x).double()).abs()
    assert (err <= bound).all()
    assert (err / bound).max() > 0.01  # not a bound so loose that every token passes


@pytest.mark.skipif(not _BF16_HEAD, reason="a bfloat16 head is screened only on AVX512-VNNI + vdpbf16ps CPUs")
@pytest.mark.parametrize("k", [64, 511, 1024])
@pytest.mark.parametrize("m", [1, 9, 300])
def test_bfloat16_head_argmax_matches(m, k):
    """The int8 screen of a bfloat16 head picks what argmax over the head's own bfloat16 logits
    picks: ties after the rounding to bfloat16 (common: 8 bits) go to the first index."""
    n = 1000
    head32, weight = _head(n, k, seed=m + k)
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.weight[7] = lin.weight[3] * (1 + 2 ** -7)  # one bfloat16 step away: ties with row 3 or not
    head = cpu_gemm.NativeLinear(lin)
    screened = greedy_head.ScreenedGreedyHead(head, "int8")
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 4).to(torch.bfloat16)
    x[0] = lin.weight[3].detach() * 30
    if m > 2:
        x[1] = 0.0
        x[2, 5] = float("nan")
    want = cpu_fused.argmax(head(x))
    got = screened.argmax(x)
    assert got.tolist() == want.tolist()
    assert screened.computed <= n + m * 60


@pytest.mark.skipif(not _BF16_HEAD, reason="a bfloat16 head is screened only on AVX512-VNNI + vdpbf16ps CPUs")
def test_bfloat16_head_rounding_ties_go_to_the_first_index():
    """Two tokens whose float32 logits differ but round to the same bfloat16 value tie in the
    head's argmax, and the first wins although the later one's float32 logit is larger. The screen
    cuts its tie margin to one bfloat16 step of the row's largest logit; both must stay in.

    Integer weights and rows with a 127 in each make the int8 screen exact, so its bound is only
    the float32 sums' (~1e-4 of ‖h‖·‖w‖) and the tie margin alone keeps the first token: the two
    logits are ~0.07 % apart, a bfloat16 step is ~0.4-0.8 %."""
    n, k, a, b = 2000, 1024, 100, 1500
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-60, 61, (n, k), generator=g).float()
    w[:, 0] = 127.0  # each row's int8 scale is then exactly 1
    w[a, 1] = 30.0
    w[b] = w[a]
    w[b, 1] = 60.0  # token b's logit is 30 · x[1] ≈ 900 above token a's, of ~1.2e6
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    head = cpu_gemm.NativeLinear(lin)
    screened = greedy_head.ScreenedGreedyHead(head, "int8")
    x = w[a] + torch.randint(-2, 3, (64, k), generator=g).float()
    x[:, 0] = 127.0
    x = x.to(torch.bfloat16)
    logits = head(x)
    want = cpu_fused.argmax(logits)
    exact = x.double() @ w.double().T
    tied = (logits[:, a] == logits[:, b]) & (exact[:, b] > exact[:, a]) & (want == a)
    assert int(tied.sum()) >= 32  # the case this test is about happens in most rows
    assert screened.argmax(x).tolist() == want.tolist()


@pytest.mark.skipif(not _BF16_HEAD, reason="a bfloat16 head is screened only on AVX512-VNNI + vdpbf16ps CPUs")
def test_engine_bfloat16_greedy_same_with_and_without_screen(llama_dir, monkeypatch):
    prompts = random_prompts(10, 300, [1, 5, 17, 33, 64, 100, 9, 130, 2, 48])
    params = SamplingParams(max_tokens=12, **GREEDY)
    runs = {}
    for mode in ("int8", "0"):
        monkeypatch.setenv("PAGEDSERVE_GREEDY_SCREEN", mode)
        llm = LLM(model=str(llama_dir), dtype="bfloat16", num_gpu_blocks_override=256)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[mode] = [o.outputs[0].token_ids for o in outs]
        head = llm.llm_engine.runner.greedy_head
        assert (head is not None and head.rows == 120) == (mode == "int8")
    assert runs["int8"] == runs["0"]


@pytest.mark.skipif(not _INT8, reason="this CPU has no AVX512-VNNI")
def test_auto_mode_gives_way_when_the_screen_keeps_too_many():
    """Hidden rows with one outlier feature (as trained models have) quantise coarsely in int8:
    in auto mode the int8 screen then hands over to the next kind, or to the plain head, after
    REVIEW_ROWS rows, and the tokens stay the head's."""
    from types import SimpleNamespace

    n, k = 4096, 512
    head, _ = _head(n, k, seed=5)
    owner = SimpleNamespace()
    screen = greedy_head.ScreenedGreedyHead(head, "int8")
    owner.greedy_head, screen.owner, screen.next_kinds = screen, owner, ["bf16"]
    x = torch.randn(greedy_head.REVIEW_ROWS, k, generator=torch.Generator().manual_seed(6))
    x[:, 0] = 60.0
    assert screen.argmax(x).tolist() == cpu_fused.argmax(head(x)).tolist()
    assert screen.computed > screen.rows * n / greedy_head.MAX_SHARE
    after = getattr(owner, "greedy_head", None)
    assert after is not screen
    if cpu_gemm.bf16_k_pairs() or not _AVX512:
        assert after.kind == "bf16" and after.next_kinds == []
        assert after.argmax(x).tolist() == cpu_fused.argmax(head(x)).tolist()
    # a screen that keeps few stays
    calm = greedy_head.ScreenedGreedyHead(head, "int8")
    owner.greedy_head, calm.owner, calm.next_kinds = calm, owner, ["bf16"]
    calm.argmax(torch.randn(greedy_head.REVIEW_ROWS, k))
    assert owner.greedy_head is calm and calm.next_kinds is None


@pytest.mark.skipif(not _INT8, reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_screen_keeps_a_winner_its_quantisation_undervalues(threads):
    """A token whose int8 screen value falls short of another's lower bound, yet wins in float32.

    Token B (column 0) is exact in int8, so its bound is nearly 0. Token A (column 300, a later
    tile) rounds down by 0.49 of its step in every coordinate, against an all-ones row that
    quantises exactly: its screen value is ~31σ under its logit, as much as its bound allows, and
    ~18σ under B's lower bound, while its logit is ~13σ over B's. Every test of A's tile must use
    A's own bound (or one above it): a tile test that used the screen values alone would skip A."""
    n, k, sigma = 1000, 64, 1e-3
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(9)) * 1e-4
    w[300] = 100.49 * sigma
    w[300, 0] = 127 * sigma  # max |w| sets A's step to σ; the others round down to 100
    w[0] = (127 * sigma + 63 * 100.49 * sigma - 13 * sigma) / k  # B: one value, exact in int8
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    head = cpu_gemm.NativeLinear(lin)
    x = torch.ones(4, k)
    logits = head(x)
    assert cpu_fused.argmax(logits).tolist() == [300] * 4 and logits[0, 300] - logits[0, 0] > 10 * sigma
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        screened = greedy_head.ScreenedGreedyHead(head, "int8")
        assert screened.argmax(x).tolist() == [300] * 4
    finally:
        torch.set_num_threads(saved)
