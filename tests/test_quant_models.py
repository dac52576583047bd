"""Quantized models through the public interfaces: LLM(model=..., quantization=...), the CLI's error
lines, and the start-up log's weight bytes.

A quantized run is compared with the same checkpoint dequantized and run dense (greedy tokens
identical): the quantized linears compute from the integers what the dense model computes from the
dequantized floats, up to the order of float32 sums.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError

PROMPTS = ["Once upon a time there was", "The quick brown fox", "What is the capital of France?",
           "Numbers like 12345 appear"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _llm(model, **kw) -> LLM:
    return LLM(model=str(model), num_gpu_blocks_override=64, max_model_len=128, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-quant"), "llama", init_std=0.08)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_kept_quantized_same_tokens_as_dequantized(tiny, tmp_path, qtype, caplog):
    import gguf
    from gguf_fixtures import write_gguf_from_hf

    path = write_gguf_from_hf(tiny, tmp_path / f"tiny-{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        quantized = _llm(path)
    assert any("gguf-quantized modules" in r.getMessage() for r in caplog.records)
    dense = _llm(path, quantization="none")
    q_engine, d_engine = quantized.llm_engine, dense.llm_engine
    assert q_engine.quantization.name == "gguf" and d_engine.quantization.dense
    # 4-bit: ~5-6 bits a weight against 32; the 8-bit Q8_0: ~9 against 32 (norms stay float32)
    assert q_engine.weight_bytes < d_engine.weight_bytes * (0.22 if qtype.startswith("Q4") else 0.32)
    assert type(q_engine.runner.model.layers[0].mlp.down_proj).__name__ == "GroupedLinear"
    assert _tokens(quantized) == _tokens(dense)
    assert q_engine.block_manager.num_free_blocks == q_engine.block_manager.num_blocks


def _write_dequantized_int8_copy(src, dst):
    """The checkpoint with every decoder linear replaced by its int8 per-channel round trip, written
    here from the definition (scale = max|row| / 127, q = round(w / scale)), as a dense reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    for name, w in sd.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = w.abs().amax(1, keepdim=True) / 127
            sd[name] = torch.round(w / scale).clamp(-127, 127) * scale
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_int8_quantized_at_load_same_tokens_as_its_dense_round_trip(tiny, tmp_path):
    quantized = _llm(tiny, quantization="int8")
    reference = _llm(_write_dequantized_int8_copy(tiny, tmp_path / "ref"))
    assert _tokens(quantized) == _tokens(reference)
    dense_bytes = reference.llm_engine.weight_bytes
    assert quantized.llm_engine.weight_bytes < dense_bytes  # embeddings and head stay float32
    qkv = quantized.llm_engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_q.bits == 8 and qkv.weight_q.group == qkv.in_features


def test_w8a8_first_tokens_agree_with_int8(tiny):
    """Per-token int8 activations move logits by ~0.5 % of their scale (the linear itself is checked
    exactly in test_quant_linear.py): each prompt's first greedy token is weight-only int8's; later
    tokens may part ways once one differs."""
    llm = _llm(tiny, quantization="w8a8")
    assert type(llm.llm_engine.runner.model.layers[1].mlp.down_proj).__name__ == "W8A8Linear"
    w8a8 = _tokens(llm)
    int8 = _tokens(_llm(tiny, quantization="int8"))
    assert [t[0] for t in w8a8] == [t[0] for t in int8]


def test_flag_errors_are_one_line(tiny, tmp_path):
    import gguf
    from gguf_fixtures import write_gguf_from_hf

    path = write_gguf_from_hf(tiny, tmp_path / "t.gguf", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ConfigError, match="--quantization int8 contradicts the checkpoint, which is quantized with gguf"):
        _llm(path, quantization="int8")
    with pytest.raises(ConfigError, match="needs a gguf checkpoint"):
        _llm(tiny, quantization="gguf")
    with pytest.raises(ConfigError, match=r"quantization='int3' is not supported; use one of awq, gptq, compressed-tensors, int8, w8a8, fp8, gguf"):
        _llm(tiny, quantization="int3")
    odd = tmp_path / "odd"
    import shutil

    shutil.copytree(tiny, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method=bitsandbytes, which pagedserve does not load; supported"):
        _llm(odd)
