"""Sampled outputs with speculation follow the target's distribution (chi-square, two samples)."""
import math
from collections import Counter

import pytest

from pagedserve import LLM, SamplingParams

N = 800  # samples per side
PROMPT = [1, 40, 41, 42, 43, 40, 41, 42]  # repeats itself, so prompt lookup drafts


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    """Large random weights: a few tokens hold most of the mass (p(top) ~ 0.25 at temperature 1),
    so greedy drafts are accepted and rejected often and the test has power."""
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-peaked"), "llama", init_std=0.5, num_layers=1)


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.29 is p = 0.0005 one-sided."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square homogeneity statistic of two equal-size samples; rare categories pooled."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    bins, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 20:
            bins.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest) >= 20:
        bins.append(tuple(rest))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)  # equal totals: sum (x - y)^2 / (x + y)
    return stat, len(bins) - 1


def _samples(llm, sp, seed0):
    params = [SamplingParams(seed=seed0 + i, **sp) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("sp", [
    dict(temperature=1.0, max_tokens=4, ignore_eos=True),
    dict(temperature=0.8, top_p=0.9, top_k=20, presence_penalty=0.8, repetition_penalty=1.2, max_tokens=4,
         ignore_eos=True),
], ids=["plain", "top_p_top_k_penalties"])
def test_sampled_tokens_follow_the_target_distribution(peaked_dir, sp):
    kw = dict(num_gpu_blocks_override=1024, max_num_seqs=256, num_threads=1)
    base = LLM(model=str(peaked_dir), **kw)
    # a draft identical to the target drafts its greedy tokens: accepted often, rejected often enough
    spec = LLM(model=str(peaked_dir), speculative_config={"method": "draft_model", "model": str(peaked_dir),
                                                          "num_speculative_tokens": 3}, **kw)
    want = _samples(base, sp, 0)
    got = _samples(spec, sp, 10_000)
    st = spec.llm_engine.spec_decoder.stats
    assert st.num_accepted_tokens > 0.2 * st.num_draft_tokens
    assert st.num_draft_tokens - st.num_accepted_tokens > 0.1 * st.num_draft_tokens
    for pos in (1, 2, 3):  # the tokens decided by verification
        stat, df = _two_sample_chi2(Counter(t[pos] for t in want), Counter(t[pos] for t in got))
        assert df >= 2 and stat < _chi2_critical(df), (pos, stat, df)
    # the joint law of consecutive tokens too (a wrong resampling rule shows up in pairs first)
    stat, df = _two_sample_chi2(Counter(t[1:3] for t in want), Counter(t[1:3] for t in got))
    assert stat < _chi2_critical(df), (stat, df)


def test_always_accepting_would_be_caught(peaked_dir):
    """The test above has the power to see a wrong rule: accepting every greedy draft (the greedy
    continuation of the sampled first token) is far from the target's distribution."""
    base = LLM(model=str(peaked_dir), num_gpu_blocks_override=1024, max_num_seqs=256, num_threads=1)
    want = _samples(base, dict(temperature=1.0, max_tokens=4, ignore_eos=True), 0)
    firsts = sorted({w[0] for w in want})
    greedy = base.generate([{"prompt_token_ids": PROMPT + [t]} for t in firsts],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    follow = {t: o.outputs[0].token_ids[0] for t, o in zip(firsts, greedy)}
    stat, df = _two_sample_chi2(Counter(w[1] for w in want), Counter(follow[w[0]] for w in want))
    assert df >= 2 and stat > _chi2_critical(df)
