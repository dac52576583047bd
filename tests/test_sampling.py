"""Sampling parameters through the public LLM API."""
import pytest

from hf_reference import hf_greedy, hf_model, random_prompts
from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_gpu_blocks_override=512, seed=0)


def _prompts(llm, n, lengths, seed):
    return [{"prompt_token_ids": p} for p in random_prompts(n, llm.llm_engine.spec.vocab_size, lengths, seed)]


def test_seeded_sampling_independent_of_batch(llm):
    target = _prompts(llm, 1, [12], seed=1)[0]
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(target, sp)[0].outputs[0].token_ids
    others = _prompts(llm, 7, [5, 40, 100], seed=2)
    mixed = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)] * 3 + [sp]
                         + [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)] * 4)
    assert mixed[3].outputs[0].token_ids == alone
    again = llm.generate([target] * 3, sp)
    assert all(o.outputs[0].token_ids == alone for o in again)
    different = llm.generate(target, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm, llama_dir):
    prompts = _prompts(llm, 4, [3, 30, 70], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(p["prompt_token_ids"]), 12)


def test_n_samples_differ_and_share_prompt(llm):
    p = _prompts(llm, 1, [20], seed=5)[0]
    out = llm.generate(p, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(seqs)) > 1 and all(len(s) == 10 for s in seqs)


def test_stop_token_ids_and_stop_strings(llm, llama_dir):
    tok = llm.get_tokenizer()
    p = _prompts(llm, 1, [10], seed=6)[0]
    ref = hf_greedy(str(llama_dir), tuple(p["prompt_token_ids"]), 20)
    stop_id = ref[5]
    first = ref.index(stop_id)
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref[: first + 1]
    full_text = tok.decode(ref, skip_special_tokens=True)
    stop_str = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    cut = full_text.index(stop_str)
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop_str]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == full_text[:cut]
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop_str],
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == full_text[:cut + len(stop_str)]
    out = llm.generate(p, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_eos_stops_unless_ignored_and_min_tokens(llama_dir):
    # make the tokenizer's EOS the model's favourite token: greedy then stops at once unless told not to
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=128)
    p = _prompts(llm, 1, [8], seed=8)[0]
    ref = hf_greedy(str(llama_dir), tuple(p["prompt_token_ids"]), 6)
    eng = llm.llm_engine
    eng.eos_ids = [ref[2]]
    out = llm.generate(p, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:3] and out.stop_reason is None
    out = llm.generate(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref
    out = llm.generate(p, SamplingParams(max_tokens=6, temperature=0, min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) >= 5 and ref[2] not in out.token_ids[:5]


def test_repetition_penalty_matches_transformers(llm, llama_dir):
    import torch

    p = _prompts(llm, 1, [16], seed=9)[0]["prompt_token_ids"]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                              repetition_penalty=1.5))[0].outputs[0].token_ids
    m = hf_model(str(llama_dir))
    ids = torch.tensor([p])
    ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                     repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    assert out == ref
    plain = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids != out


def test_presence_and_frequency_penalties_discourage_repeats(llm):
    p = _prompts(llm, 1, [4], seed=10)[0]
    base = llm.generate(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    pen = llm.generate(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=2.0,
                                         frequency_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(pen)) > len(set(base))


def test_top_p_and_min_p_restrict_choices(llm):
    import torch

    p = _prompts(llm, 1, [10], seed=12)[0]
    eng = llm.llm_engine
    # tiny top_p / large min_p keep only the most likely token: identical to greedy
    g = llm.generate(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    for sp in (SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, ignore_eos=True, seed=3),
               SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, ignore_eos=True, seed=3)):
        assert llm.generate(p, sp)[0].outputs[0].token_ids == g
    assert torch.get_num_threads() >= 1 and eng is not None
