"""Speculative decoding keeps greedy output token-identical, whatever the method and batch shape."""
import pytest

from hf_reference import random_prompts
from pagedserve import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
ONE_THREAD = dict(num_threads=1)  # tiny models: one thread is fastest and does not spin on a busy host
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    """Same tokenizer and shape as llama_dir, other random weights: its drafts are mostly wrong."""
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1, num_layers=1)


def _methods(llama_dir, random_draft_dir):
    return {
        "ngram": NGRAM,
        "suffix": SUFFIX,
        "draft_same": {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3},
        "draft_random": {"method": "draft_model", "model": str(random_draft_dir), "num_speculative_tokens": 3},
    }


METHODS = ["ngram", "suffix", "draft_same", "draft_random"]


def _repetitive_prompts(vocab, n, seed):
    """Prompts that repeat part of themselves, so prompt lookup and suffix trees find drafts."""
    return [p + p[: len(p) // 2] for p in random_prompts(n, vocab, [6, 40, 90, 17, 60], seed=seed)]


def _generate(llm, prompts, sp):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp)


def _pool_full(llm):
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def _compare(llama_dir, spec, prompts, sp, twice=False, **engine_kw):
    engine_kw.update(ONE_THREAD)
    base = LLM(model=str(llama_dir), **engine_kw)
    llm = LLM(model=str(llama_dir), speculative_config=spec, **engine_kw)
    rounds = 2 if twice else 1  # a second round hits the prefix cache (and the suffix method's server-wide tree)
    for _ in range(rounds):
        want = _generate(base, prompts, sp)
        got = _generate(llm, prompts, sp)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert _pool_full(llm)
    return llm, got


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_mixed_batch_and_prefix_hits(llama_dir, random_draft_dir, method):
    spec = _methods(llama_dir, random_draft_dir)[method]
    prompts = _repetitive_prompts(384, 6, seed=1)
    llm, _ = _compare(llama_dir, spec, prompts, SamplingParams(max_tokens=24, **GREEDY), twice=True,
                      num_gpu_blocks_override=256)
    eng = llm.llm_engine
    st = eng.spec_decoder.stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    assert eng.block_manager.hit_tokens > 0  # the second round reused cached prompt blocks
    rate = st.num_accepted_tokens / st.num_draft_tokens
    if method == "draft_same":  # a draft identical to the target is always right
        assert st.num_accepted_tokens == st.num_draft_tokens
    elif method == "draft_random":
        assert rate < 0.5
    else:
        assert rate > 0.2


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_random"])
def test_greedy_identical_chunked_prefill_and_preemption(llama_dir, random_draft_dir, method):
    spec = _methods(llama_dir, random_draft_dir)[method]
    prompts = _repetitive_prompts(384, 8, seed=2)
    prompts = [p[:44] for p in prompts]
    # 12 blocks of 16 tokens cannot hold eight sequences growing to ~75 tokens; 40 tokens per step
    # split the prompts and leave some steps too short for every draft
    llm, _ = _compare(llama_dir, spec, prompts, SamplingParams(max_tokens=30, **GREEDY),
                      num_gpu_blocks_override=12, max_num_seqs=8, max_model_len=192, max_num_batched_tokens=40)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec_decoder.stats.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft_same"])
def test_stops_inside_an_accepted_run(llama_dir, random_draft_dir, method):
    """Stop strings, stop token ids and max_tokens that fall between the drafts of one step."""
    spec = _methods(llama_dir, random_draft_dir)[method]
    base = LLM(model=str(llama_dir), num_gpu_blocks_override=128, **ONE_THREAD)
    prompts = _repetitive_prompts(384, 3, seed=3)
    full = _generate(base, prompts, SamplingParams(max_tokens=30, **GREEDY))
    tok = base.get_tokenizer()
    stop_ids, stop_strs = [], []
    for o in full:
        ids = o.outputs[0].token_ids
        stop_ids.append(ids[13])
        stop_strs.append(tok.decode(ids[17:19]))
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=128, speculative_config=spec, **ONE_THREAD)
    for i, p in enumerate(prompts):
        for sp in (SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_ids[i]]),
                   SamplingParams(max_tokens=30, temperature=0, stop=[stop_strs[i]], ignore_eos=True),
                   SamplingParams(max_tokens=11, **GREEDY)):
            want = _generate(base, [p], sp)[0].outputs[0]
            got = _generate(llm, [p], sp)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                   (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert llm.llm_engine.spec_decoder.stats.num_accepted_tokens > 0
    assert _pool_full(llm)


def test_logprobs_and_penalties_with_drafts(llama_dir):
    """Greedy rows that ask for logprobs and repetition penalties: the same tokens and logprobs."""
    prompts = _repetitive_prompts(384, 4, seed=4)
    sp = SamplingParams(max_tokens=20, temperature=0, logprobs=2, repetition_penalty=1.3, ignore_eos=True)
    base = LLM(model=str(llama_dir), num_gpu_blocks_override=128, **ONE_THREAD)
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=128, speculative_config=NGRAM, **ONE_THREAD)
    for w, g in zip(_generate(base, prompts, sp), _generate(llm, prompts, sp)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for t in lw:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)
    assert llm.llm_engine.spec_decoder.stats.num_accepted_tokens > 0


def test_low_acceptance_turns_speculation_off(llama_dir, random_draft_dir):
    spec = {"method": "draft_model", "model": str(random_draft_dir), "num_speculative_tokens": 3,
            "acceptance_disable_threshold": 0.9, "acceptance_window": 6}
    prompts = _repetitive_prompts(384, 3, seed=5)
    llm, _ = _compare(llama_dir, spec, prompts, SamplingParams(max_tokens=30, **GREEDY), num_gpu_blocks_override=128)
    st = llm.llm_engine.spec_decoder.stats
    # each sequence stops drafting after a few verifications instead of drafting on all 40 tokens
    assert 0 < st.num_drafts <= 3 * 6
