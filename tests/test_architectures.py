"""Config-driven architecture details: Mistral, sliding windows, Llama-3 RoPE scaling."""
import pytest

from hf_reference import hf_greedy, random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError


def test_mistral_sliding_window_is_honoured_by_capping_the_length(tmp_path):
    from tiny_models import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / "mistral", "mistral", extra_config={"sliding_window": 128})
    llm = LLM(model=str(d), num_gpu_blocks_override=64)
    assert llm.llm_engine.config.max_model_len == 128  # within the window attention is exact
    prompts = random_prompts(3, llm.llm_engine.spec.vocab_size, [10, 60, 100], seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(str(d), tuple(p), 8)
    with pytest.raises(ConfigError, match="sliding-window.*--max-model-len 128"):
        LLM(model=str(d), max_model_len=256, num_gpu_blocks_override=64)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from tiny_models import make_tiny_checkpoint

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    d = make_tiny_checkpoint(tmp_path / "llama3", "llama", rope_theta=500000.0, max_position_embeddings=512,
                             extra_config={"rope_scaling": scaling, "head_dim": 32}, num_heads=4, hidden_size=64)
    llm = LLM(model=str(d), num_gpu_blocks_override=64)
    assert llm.llm_engine.spec.rope_scaling["rope_type"] == "llama3" and llm.llm_engine.spec.head_dim == 32
    prompts = random_prompts(3, llm.llm_engine.spec.vocab_size, [20, 150, 300], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(str(d), tuple(p), 8)


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 64}),
                                          ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})])
def test_spec_read_from_config_json_equals_the_one_from_transformers(tmp_path, arch, extra):
    """Start-up reads config.json itself (no transformers config import); it must see what transformers sees."""
    import json

    from transformers import AutoConfig

    from pagedserve.model.spec import ModelSpec
    from tiny_models import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / arch, arch, extra_config=extra)
    cfg = json.loads((d / "config.json").read_text())
    fast = ModelSpec.from_complete_config_dict(cfg)
    assert fast is not None and fast == ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(d)))
    # a config that leaves a model-type default unstated goes through transformers instead
    for key in ("num_key_value_heads", "tie_word_embeddings"):
        assert ModelSpec.from_complete_config_dict({k: v for k, v in cfg.items() if k != key}) is None
    if arch == "mistral":  # Mistral's default window is 4096, not "none"
        assert ModelSpec.from_complete_config_dict({k: v for k, v in cfg.items() if k != "sliding_window"}) is None
