"""The native CPU paged-attention kernel against a plain torch reference, and both engine paths."""
import pytest
import torch

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import paged_attention as cpu_kernels


def _reference(q, kc, vc, bt, lens, scale):
    b_, h, d = q.shape
    _, bs, kvh, _ = kc.shape
    out = torch.empty(b_, h, d)
    for b in range(b_):
        pos = torch.arange(int(lens[b]))
        slots = bt[b][pos // bs] * bs + pos % bs
        k = kc.reshape(-1, kvh, d)[slots].float().repeat_interleave(h // kvh, 1)
        v = vc.reshape(-1, kvh, d)[slots].float().repeat_interleave(h // kvh, 1)
        p = (torch.einsum("hd,lhd->hl", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", p, v)
    return out


def _kernel_or_skip():
    if cpu_kernels.load() is None:
        pytest.skip(f"native CPU kernel unavailable here: {cpu_kernels.failure_reason()}")


def _random_kv(g, n_blocks, block_size, kv_heads, head_dim, dtype):
    """Random key and value block pools [n_blocks, block_size, kv_heads, head_dim]."""
    return tuple(torch.randn(n_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads, block_size", [(8, 8, 16), (8, 2, 32), (16, 2, 16)])
def test_kernel_matches_reference(dtype, tol, heads, kv_heads, block_size):
    _kernel_or_skip()
    g = torch.Generator().manual_seed(0)
    n_blocks, d, b = 96, 64, 7
    kc, vc = _random_kv(g, n_blocks, block_size, kv_heads, d, dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 100, 257, 300])
    bt = torch.stack([torch.randperm(n_blocks, generator=g)[:-(-300 // block_size)] for _ in range(b)])
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    got = cpu_kernels.paged_decode_attention(q, kc, vc, bt, lens, d ** -0.5)
    assert torch.allclose(got.float(), _reference(q, kc, vc, bt, lens, d ** -0.5), atol=tol)


# (head_dim, block_size, heads, kv_heads): the vector path; a head size that is not a multiple of 8
# (the scalar path); odd numbers of 8-wide vectors per head and per block (the tiles' remainders);
# three query heads per kv head; no grouping. The tiled rows walk spans of up to 64 keys: 8 blocks
# of 8, 2 of 24 (48 keys), one 128-key block (two column groups), 2 of 32 with head size 128 (two
# groups of dims), head size 80 (a 64-dim group and a 16-dim one) on blocks of 40, 12 blocks of 5
# (60 keys, a part vector), one 64-token block with head size 32.
@pytest.mark.parametrize("head_dim, bs, heads, kv_heads", [(64, 16, 8, 2), (12, 16, 8, 2), (40, 24, 8, 2),
                                                           (64, 16, 6, 2), (64, 8, 4, 4), (48, 24, 4, 1),
                                                           (64, 128, 8, 2), (128, 32, 8, 2), (80, 40, 6, 3),
                                                           (64, 5, 8, 2), (32, 64, 4, 2)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_kernel_prompt_chunks_attend_causally_over_their_context(head_dim, bs, heads, kv_heads, dtype, tol):
    """Several query tokens per sequence (a prompt chunk after cached context), mixed with decodes."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(1)
    n_blocks = 64
    kc, vc = _random_kv(g, n_blocks, bs, kv_heads, head_dim, dtype)
    # decodes, a chunk after 17 cached tokens, whole prompts (one over several query chunks), ...
    lens = [1, 40, 37, 200, 9, 75]
    q_lens = [1, 1, 20, 37, 9, 75]
    bt = torch.stack([torch.randperm(n_blocks, generator=g)[:-(-200 // bs)] for _ in lens])
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0)
    got = cpu_kernels.paged_attention(q, kc, vc, bt, torch.tensor(lens), starts, head_dim ** -0.5)
    for b, (n, qn) in enumerate(zip(lens, q_lens)):
        for i in range(qn):  # query i sits at position n - qn + i and sees keys up to there
            row = starts[b] + i
            want = _reference(q[row:row + 1], kc, vc, bt[b:b + 1], torch.tensor([n - qn + i + 1]), head_dim ** -0.5)
            assert torch.allclose(got[row:row + 1].float(), want, atol=tol), (b, i)


# (heads, kv_heads): G = 2; no grouping (G = 1); G = 8, where a decode alone fills a tile;
# (bs, d): blocks of 16, and a shared prefix walked as 2-block spans with head size 128
@pytest.mark.parametrize("heads, kv_heads, bs, d", [(8, 4, 16, 64), (4, 4, 16, 64), (8, 1, 16, 64), (8, 2, 32, 128)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_kernel_decodes_sharing_prefix_blocks(heads, kv_heads, bs, d, dtype, tol):
    """Decodes whose block tables start with the same blocks (prefix-cache hits) read those blocks
    together; each must still get exactly its own attention."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(2)
    n_blocks = 600
    kc, vc = _random_kv(g, n_blocks, bs, kv_heads, d, dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    fresh = iter(perm[30:])
    tables, lens = [], []

    def on_prefix(prefix, n):  # a sequence of n tokens whose table starts with `prefix`
        own = -(-n // bs)
        tables.append(prefix[:own] + [next(fresh) for _ in range(own - len(prefix))])
        lens.append(n)

    # 40 sequences on a 10-block prefix (more than one work item's worth: 32), lengths ending on
    # a block boundary, one token past it, and further on
    for i in range(40):
        on_prefix(perm[:10], [160, 161, 176, 300, 250, 175][i % 6])
    # 6 on a 6-block prefix, one of them only 70 tokens long: the group shares its 4 full blocks
    for n in (70, 200, 200, 130, 150, 97):
        on_prefix(perm[10:16], n)
    # 3 on a 5-block prefix (too few to group), and 2 alone
    for n in (120, 90, 150):
        on_prefix(perm[16:21], n)
    for n in (64, 33):
        on_prefix([], n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    got = cpu_kernels.paged_decode_attention(q, kc, vc, bt, torch.tensor(lens), d ** -0.5)
    want = _reference(q, kc, vc, bt, torch.tensor(lens), d ** -0.5)
    for b in range(len(lens)):
        assert torch.allclose(got[b].float(), want[b], atol=tol), b


def test_engine_greedy_same_with_and_without_native_kernel(llama_dir, monkeypatch):
    _kernel_or_skip()
    prompts = random_prompts(6, 300, [5, 40, 130], seed=4)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    native = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    assert native.llm_engine.runner.backend.name == "cpu-paged (native kernel)"  # as logged at load
    a = native.generate(reqs, sp)  # before the kernel is taken away below: the kernel's calls look it up
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    gather = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    assert gather.llm_engine.runner.backend.name == "torch-sdpa"
    b = gather.generate(reqs, sp)
    for p, x, y in zip(prompts, a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 10)


# (heads, kv_heads, head_dim, block_size): every group size the decode kernel has (1-8 query heads
# per kv head), both its head sizes, blocks shorter and longer than its 16-token steps and not a
# multiple of them
@pytest.mark.parametrize("heads, kv_heads, head_dim, bs", [(4, 4, 64, 16), (8, 4, 64, 16), (9, 3, 64, 8),
                                                           (16, 4, 128, 32), (10, 2, 64, 24), (12, 2, 128, 16),
                                                           (14, 2, 64, 16), (8, 1, 128, 16)])
@pytest.mark.parametrize("decode_kernel", [True, False])
@pytest.mark.parametrize("dot", [True, False])
def test_bf16_decodes_within_rounding_of_float32_attention(heads, kv_heads, head_dim, bs, decode_kernel, dot):
    """bfloat16 decodes, on the AVX-512 decode kernel (where this CPU has it) and on the row path,
    with and without shared-prefix blocks: both sum in float32, so each output may differ from a
    float32 reference on the same bfloat16 inputs only by its final rounding to bfloat16. Where the
    shared prefix goes through the AMX tiles or the vdpbf16ps walk, its probabilities are rounded
    to bfloat16 for the P V product (2^-9 of each weight), as on the prompt path: those rows get
    that much more. With `dot` (where the CPU has AVX512-BF16) the decode kernel's scores run on
    vdpbf16ps (exact products, float32 sums) and keep the same bound."""
    _kernel_or_skip()
    if cpu_kernels.set_bf16_dot(dot) != dot:
        cpu_kernels.set_bf16_dot(None)
        pytest.skip("no AVX512-BF16 on this CPU (the vdpbf16ps paths are not built)")
    g = torch.Generator().manual_seed(3)
    n_blocks = 160
    kc, vc = _random_kv(g, n_blocks, bs, kv_heads, head_dim, torch.bfloat16)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    prefix, fresh = perm[:6], iter(perm[6:])
    lens = [1, bs - 1, bs + 1, 3 * bs, 130, 6 * bs + 5, 6 * bs + 1, 7 * bs, 9 * bs, 6 * bs + 2]
    tables = []
    for b, n in enumerate(lens):  # the last five share a 6-block prefix (read together)
        own = -(-n // bs)
        head = prefix[:own] if b >= 5 else []
        tables.append(head + [next(fresh) for _ in range(own - len(head))])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(torch.bfloat16)
    try:
        cpu_kernels.set_decode_kernel(decode_kernel)
        got = cpu_kernels.paged_decode_attention(q, kc, vc, bt, torch.tensor(lens), head_dim ** -0.5).float()
    finally:
        cpu_kernels.set_decode_kernel(True)
        cpu_kernels.set_bf16_dot(None)
    want = _reference(q, kc, vc, bt, torch.tensor(lens), head_dim ** -0.5)
    # half a bfloat16 unit of the result, plus float32 summation-order slack
    bound = want.abs() * 2.0 ** -8 + 1e-5
    if cpu_kernels.set_amx(True) or dot:  # the shared-prefix rows: + the probabilities' rounding
        bound[5:] += vc.float().abs().max() * 2.0 ** -9
    assert ((got - want).abs() <= bound).all()


# (heads, kv_heads, head_dim, block_size): the small model's shape; 64-key spans of 8-token
# blocks; one 128-key block (two score tile groups); head size 128 (two tile groups of dims);
# head size 96 (a group of 64 dims and one of 32) with 48-key spans of 24-token blocks; G = 1
BF16_PROMPT_SHAPES = [(8, 4, 64, 16), (4, 4, 64, 8), (8, 2, 64, 128), (8, 2, 128, 32), (6, 2, 96, 24), (4, 4, 64, 16)]


def _bf16_prompt_chunks_within_rounding(heads, kv_heads, head_dim, bs, switch):
    """bfloat16 prompt chunks (and decodes) on a fast path that switch(True) turns on against a
    float32 reference on the same inputs, with the pool's unused slots holding NaN: products of
    bfloat16 values are exact and sum in float32, so the output may differ only by its final
    rounding and the probabilities' rounding to bfloat16 (2^-9 of each weight), and never read a
    slot past the context. The float32 tiled path (switch(False)) must agree to the same bound."""
    g = torch.Generator().manual_seed(5)
    n_blocks = 160
    kc, vc = (torch.full((n_blocks, bs, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    # decodes, a chunk after cached context, whole prompts over several query chunks (the AMX
    # path's are 128 queries: 260 = 128 + 128 + 4, 129 ends on a one-query chunk), a prompt ending
    # one token into a block, odd and even context lengths (the dot walk sums tokens in pairs)
    lens = [1, 60, 300, 75, 2 * bs + 1, 190, 260, 129]
    q_lens = [1, 1, 100, 75, 2 * bs + 1, 33, 260, 129]
    perm = iter(torch.randperm(n_blocks, generator=g).tolist())
    tables = [[next(perm) for _ in range(-(-n // bs))] for n in lens]
    for t, n in zip(tables, lens):
        pos = torch.arange(n)
        slots = torch.tensor(t)[pos // bs] * bs + pos % bs
        for cache in (kc, vc):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(torch.bfloat16)
    starts = torch.tensor([0] + q_lens).cumsum(0)
    scale = head_dim ** -0.5
    got = {}
    try:
        for fast in (True, False):
            switch(fast)
            got[fast] = cpu_kernels.paged_attention(q, kc, vc, bt, torch.tensor(lens), starts, scale).float()
    finally:
        switch(None)
    for b, (n, qn) in enumerate(zip(lens, q_lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        want = torch.cat([_reference(q[starts[b] + i:starts[b] + i + 1], kc, vc, bt[b:b + 1],
                                     torch.tensor([n - qn + i + 1]), scale) for i in range(qn)])
        vmax = vc.view(-1, kv_heads, head_dim)[torch.tensor(tables[b])[torch.arange(n) // bs] * bs
                                               + torch.arange(n) % bs].float().abs().max()
        bound = want.abs() * 2.0 ** -8 + vmax * 2.0 ** -9 + 1e-5
        for fast in (True, False):
            assert torch.isfinite(got[fast][rows]).all(), (b, fast)
            assert ((got[fast][rows] - want).abs() <= bound).all(), (b, fast)
    return got


@pytest.mark.parametrize("heads, kv_heads, head_dim, bs", BF16_PROMPT_SHAPES)
def test_bf16_prompt_chunks_on_amx_within_rounding_of_float32_attention(heads, kv_heads, head_dim, bs):
    """The AMX tiles (where this CPU has them): see _bf16_prompt_chunks_within_rounding."""
    _kernel_or_skip()
    if not cpu_kernels.set_amx(True):
        pytest.skip("no AMX-BF16 on this CPU (or the OS does not grant the tiles)")
    _bf16_prompt_chunks_within_rounding(heads, kv_heads, head_dim, bs,
                                        lambda on: cpu_kernels.set_amx(True if on is None else on))


@pytest.mark.parametrize("heads, kv_heads, head_dim, bs", BF16_PROMPT_SHAPES)
def test_bf16_prompt_chunks_on_vdpbf16ps_within_rounding_of_float32_attention(heads, kv_heads, head_dim, bs):
    """The tiled path's vdpbf16ps walk (where this CPU has AVX512-BF16; AMX off, so prompt chunks
    reach it): see _bf16_prompt_chunks_within_rounding. The two walks must really differ (the dot
    walk's rounded probabilities), so the switch is known to take effect."""
    _kernel_or_skip()
    if not cpu_kernels.set_bf16_dot(True):
        cpu_kernels.set_bf16_dot(None)
        pytest.skip("no AVX512-BF16 on this CPU (the vdpbf16ps walk is not built)")
    amx = cpu_kernels.set_amx(False)
    try:
        got = _bf16_prompt_chunks_within_rounding(heads, kv_heads, head_dim, bs, cpu_kernels.set_bf16_dot)
    finally:
        cpu_kernels.set_amx(True)
    assert not torch.equal(got[True], got[False]), amx
