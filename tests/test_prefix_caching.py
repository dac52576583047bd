"""Prefix caching: shared prompt prefixes reuse KV blocks, outputs never change."""
import pytest

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _w3_like(vocab, n=10, prefix_len=192, suffix_len=16, seed=0):
    prefix = random_prompts(1, vocab, [prefix_len], seed=seed)[0]
    return [prefix + s for s in random_prompts(n, vocab, [suffix_len], seed=seed + 1)]


def _full(llm):
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def on_off(llama_dir):
    kw = dict(model=str(llama_dir), num_gpu_blocks_override=512, max_num_batched_tokens=4096)
    return LLM(enable_prefix_caching=True, **kw), LLM(enable_prefix_caching=False, **kw)


def test_outputs_identical_with_caching_on_and_off(on_off, llama_dir):
    on, off = on_off
    prompts = _w3_like(on.llm_engine.spec.vocab_size)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(max_tokens=10, **GREEDY)
    a, b = on.generate(reqs, greedy), off.generate(reqs, greedy)
    for p, x, y in zip(prompts, a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 10)
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(len(reqs))]
    a, b = on.generate(reqs, seeded), off.generate(reqs, seeded)
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
    assert on.llm_engine.block_manager.hit_tokens > 0 and off.llm_engine.block_manager.hit_tokens == 0
    assert _full(on) and _full(off)


def test_hit_counts_for_the_w3_pattern(llama_dir):
    # 10 requests: one 192-token prefix (12 full blocks) + a unique 16-token suffix, admitted in one step.
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=512, max_num_batched_tokens=4096)
    bm = llm.llm_engine.block_manager
    prompts = _w3_like(llm.llm_engine.spec.vocab_size, seed=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, **GREEDY))
    assert bm.query_tokens == 10 * 208
    assert bm.hit_tokens == 9 * 192  # every request after the first reuses all 12 prefix blocks
    stats = llm.llm_engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2080, 1728)
    # a later request with the same prefix hits the cached (freed but kept) blocks
    llm.generate({"prompt_token_ids": prompts[0][:192] + [7] * 5}, SamplingParams(max_tokens=2, **GREEDY))
    assert bm.hit_tokens == 10 * 192
    assert _full(llm)


def test_eviction_under_memory_pressure_keeps_outputs_correct(llama_dir):
    # 40 blocks, 6 different 96-token prefixes used twice each: the cache must evict and recompute.
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=40, max_model_len=256, max_num_seqs=4)
    vocab = llm.llm_engine.spec.vocab_size
    groups = [_w3_like(vocab, n=2, prefix_len=96, suffix_len=8, seed=10 + g) for g in range(6)]
    prompts = [p for g in groups for p in g] + [g[0] for g in groups]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p), 12)
    bm = llm.llm_engine.block_manager
    assert bm.hit_tokens > 0 and len(bm.cached) <= bm.num_blocks
    assert _full(llm)


def test_second_chat_turn_reuses_first_turn_blocks(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    bm = llm.llm_engine.block_manager
    system = {"role": "system", "content": "You are a helpful assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
    first = llm.chat(turn1, SamplingParams(max_tokens=20, **GREEDY))[0]
    n_prompt1 = len(first.prompt_token_ids)
    hits_before = bm.hit_tokens
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "And what about Paris?"}]
    second = llm.chat(turn2, SamplingParams(max_tokens=5, **GREEDY))[0]
    assert second.prompt_token_ids[:n_prompt1] == first.prompt_token_ids
    assert bm.hit_tokens - hits_before >= (n_prompt1 // 16) * 16 >= 16


def test_n_samples_share_their_prompt_blocks(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256)
    bm = llm.llm_engine.block_manager
    p = random_prompts(1, llm.llm_engine.spec.vocab_size, [100], seed=3)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert bm.hit_tokens == 2 * 96  # samples 2 and 3 reuse the 6 full prompt blocks of sample 1
    assert _full(llm)


def test_prompt_logprobs_bypass_the_cache(on_off):
    on, _ = on_off
    p = _w3_like(on.llm_engine.spec.vocab_size, n=1, seed=9)[0]
    on.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1, **GREEDY))
    out = on.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))[0]
    assert len(out.prompt_logprobs) == len(p) and all(x is not None for x in out.prompt_logprobs[1:])
