"""Greedy outputs of the engine are token-identical to transformers, whatever the batching."""
import pytest

from hf_reference import hf_greedy, hf_logprobs, random_prompts
from pagedserve import LLM, SamplingParams

LENGTHS = [1, 3, 7, 16, 17, 31, 33, 64, 100, 129, 200, 257, 300, 5, 48, 90, 150, 12, 2, 280, 77, 40, 9, 160]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _check(llm, model_dir, prompts, max_tokens):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == hf_greedy(str(model_dir), tuple(p), max_tokens), f"prompt of {len(p)} tokens"


def _pool_full(llm):
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def test_single_prompt_text(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, **GREEDY))[0]
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox")
    assert out.prompt_token_ids == ids
    ref = hf_greedy(str(llama_dir), tuple(ids), 24)
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert _pool_full(llm)


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_llama_gqa(llama_dir, block_size):
    llm = LLM(model=str(llama_dir), block_size=block_size, num_gpu_blocks_override=2048 // block_size * 4)
    prompts = random_prompts(24, llm.llm_engine.spec.vocab_size, LENGTHS, seed=block_size)
    _check(llm, llama_dir, prompts, 12)
    assert _pool_full(llm)


def test_mixed_batch_qwen2_bias_tied(qwen2_dir):
    llm = LLM(model=str(qwen2_dir), num_gpu_blocks_override=512)
    spec = llm.llm_engine.spec
    assert spec.attention_bias and spec.tie_word_embeddings and spec.num_kv_heads == 1
    prompts = random_prompts(20, spec.vocab_size, LENGTHS, seed=7)
    _check(llm, qwen2_dir, prompts, 10)


def test_chunked_prefill_small_token_budget(llama_dir):
    llm = LLM(model=str(llama_dir), max_num_batched_tokens=40, max_num_seqs=8, num_gpu_blocks_override=400)
    prompts = random_prompts(10, llm.llm_engine.spec.vocab_size, [300, 90, 1, 45, 130], seed=3)
    _check(llm, llama_dir, prompts, 10)


def test_preemption_keeps_outputs_exact(llama_dir):
    # 8 blocks of 16 tokens: eight ~40-token sequences growing to ~70 tokens cannot all stay resident.
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=12, max_num_seqs=8, max_model_len=192)
    prompts = random_prompts(8, llm.llm_engine.spec.vocab_size, [40, 35, 44, 30], seed=11)
    _check(llm, llama_dir, prompts, 30)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert _pool_full(llm)


def test_requests_added_while_others_run(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256, max_num_batched_tokens=64)
    eng = llm.llm_engine
    vocab = eng.spec.vocab_size
    first = random_prompts(6, vocab, [20, 70, 5], seed=21)
    later = random_prompts(6, vocab, [33, 2, 120], seed=22)
    p = SamplingParams(max_tokens=14, **GREEDY)
    for i, ids in enumerate(first):
        eng.add_request(f"a{i}", params=p, prompt_token_ids=ids)
    done = {}
    for _ in range(5):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    for i, ids in enumerate(later):
        eng.add_request(f"b{i}", params=p, prompt_token_ids=ids)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    for tag, group in (("a", first), ("b", later)):
        for i, ids in enumerate(group):
            assert done[f"{tag}{i}"].outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(ids), 14)


def test_logprobs_match_transformers(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64)
    prompt = random_prompts(1, llm.llm_engine.spec.vocab_size, [20], seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    gen = out.outputs[0].token_ids
    ref = hf_logprobs(str(llama_dir), prompt + gen)
    for i, (tid, lp) in enumerate(zip(gen, out.outputs[0].logprobs)):
        pos = len(prompt) - 1 + i
        assert lp[tid].logprob == pytest.approx(ref[pos, tid].item(), abs=1e-4)
        assert lp[tid].rank == 1  # greedy picks the top token
        top = ref[pos].topk(3)
        assert set(lp) == set(top.indices.tolist())
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(l[t].logprob for t, l in zip(gen, out.outputs[0].logprobs)), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
