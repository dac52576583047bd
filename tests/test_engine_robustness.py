"""Bad input is refused clearly, the engine keeps serving, and no KV block leaks."""
import pytest

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, EngineConfig, SamplingParams
from pagedserve.errors import ConfigError, InvalidRequestError


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_gpu_blocks_override=64, max_model_len=256)


def _full(llm):
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("prompt, params, param", [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [1, -3]}, SamplingParams(), "prompt"),
    ("hello", SamplingParams(max_tokens=0), "max_tokens"),
    ("hello", SamplingParams(max_tokens=-2), "max_tokens"),
    ("hello", SamplingParams(temperature=-0.5), "temperature"),
    ("hello", SamplingParams(top_p=0.0), "top_p"),
    ("hello", SamplingParams(top_p=1.5), "top_p"),
    ("hello", SamplingParams(n=0), "n"),
    ("hello", SamplingParams(logprobs=1000), "logprobs"),
    ({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=4), "prompt"),
    ({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=100), "max_tokens"),
])
def test_bad_input_is_a_clear_error_and_next_request_is_served(llm, llama_dir, prompt, params, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt, params)
    assert e.value.param == param and str(e.value)
    assert not llm.llm_engine.has_unfinished_requests() and _full(llm)
    ids = [1, 40, 41, 42]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(ids), 5)


def test_context_length_message_says_what_to_change(llm):
    with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens.*reduce"):
        llm.generate({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=100))


def test_bad_request_in_a_batch_does_not_leave_the_others_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["good prompt", ""], SamplingParams(max_tokens=3))
    assert not llm.llm_engine.has_unfinished_requests() and _full(llm)


def test_pool_back_to_full_after_finish_and_abort(llm):
    eng = llm.llm_engine
    prompts = random_prompts(6, eng.spec.vocab_size, [30, 70, 5], seed=1)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), params=SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), prompt_token_ids=p)
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    eng.abort_request("0")
    eng.abort_request("3")
    eng.abort_request("no-such-request")
    finished = set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished.add(o.request_id)
    assert finished == {"1", "2", "4", "5"}
    assert _full(llm)
    assert eng.stats().kv_cache_usage == 0.0 and eng.stats().num_running == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=24), "block_size=24 is not supported"),
    (dict(max_model_len=5000), "above the model's limit of 1024"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=100), "raise --max-num-batched-tokens"),
    (dict(num_gpu_blocks_override=4), "lower --max-model-len to 64"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(dtype="int3"), "dtype"),
])
def test_invalid_config_fails_at_start_with_the_fix(llama_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(llama_dir), **kwargs)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from pagedserve.model.spec import ModelSpec
    from transformers import AutoConfig

    with pytest.raises(ConfigError, match="LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(tmp_path)))


def test_engine_config_defaults_follow_vllm():
    c = EngineConfig()
    assert (c.max_num_seqs, c.block_size, c.gpu_memory_utilization, c.enable_prefix_caching, c.enable_chunked_prefill) == (
        256, 16, 0.9, True, True)


@pytest.mark.parametrize("params, param", [
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=float("inf")), "top_p"),
    (SamplingParams(seed=2**70), "seed"),
])
def test_non_finite_and_out_of_range_values_are_refused(llm, params, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("hello", params)
    assert e.value.param == param
