"""AWQ / GPTQ checkpoints written by tests/quant_packers.py load through LLM(model=dir) and give the
same greedy tokens as the dense checkpoint of the weights they decode to; broken files fail at start
with one error naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError

PROMPTS = ["Once upon a time there was", "The quick brown fox", "What is the capital of France?"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _tokens(model, **kw):
    llm = LLM(model=str(model), dtype="float32", num_gpu_blocks_override=64, max_model_len=128, **kw)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)], llm.llm_engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qck"), "llama", init_std=0.08)


CASES = {
    "awq-g32": dict(fmt="awq", bits=4, group=32),
    "gptq-4bit-asym": dict(fmt="gptq", bits=4, group=32),
    "gptq-4bit-sym-act-order": dict(fmt="gptq", bits=4, group=32, sym=True, act_order=True),
    "gptq-8bit-sym-g64": dict(fmt="gptq", bits=8, group=64, sym=True),
    "gptq-8bit-asym-act-order": dict(fmt="gptq", bits=8, group=32, act_order=True),
    "ct-w4a16-g32": dict(fmt="compressed-tensors", bits=4, group=32, sym=True),
    "ct-w8a16-g64": dict(fmt="compressed-tensors", bits=8, group=64, sym=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_checkpoint_same_tokens_as_its_dense_weights(tiny, tmp_path, case):
    from quant_packers import pack_checkpoint

    qdir, rdir = pack_checkpoint(tiny, tmp_path, **CASES[case])
    got, engine = _tokens(qdir)
    want, dense = _tokens(rdir)
    assert got == want
    fmt = CASES[case]["fmt"]
    assert engine.quantization.name == fmt
    assert engine.weight_bytes < dense.weight_bytes
    layer = engine.runner.model.layers[0]
    assert hasattr(layer.mlp.gate_up_proj, "weight_q") and hasattr(layer.self_attn.qkv_proj, "weight_q")
    if CASES[case].get("act_order"):
        assert layer.mlp.down_proj.weight_q.perm is not None
    # --quantization none: the same checkpoint dequantized into the dense model
    assert _tokens(qdir, quantization="none")[0] == want


@pytest.mark.parametrize("fmt", ["ct-fp8", "fp8", "w8a8-int8"])
def test_per_channel_checkpoints(tiny, tmp_path, fmt):
    """FP8 (compressed-tensors per channel, vLLM's per tensor) gives the dense tokens of its decoded
    weights; W8A8-int8 quantizes activations too, so its first token per prompt is the check (the
    linear itself is tested exactly in test_quant_linear.py)."""
    from quant_packers import pack_per_channel

    qdir, rdir = pack_per_channel(tiny, tmp_path, fmt)
    got, engine = _tokens(qdir)
    want, _ = _tokens(rdir)
    down = engine.runner.model.layers[1].mlp.down_proj
    if fmt == "w8a8-int8":
        assert type(down).__name__ == "W8A8Linear"
        assert [t[0] for t in got] == [t[0] for t in want]
    else:
        assert type(down).__name__ == "Fp8Linear" and down.weight_q.weight.dtype == torch.float8_e4m3fn
        assert got == want


def test_dynamic_fp8_from_full_precision(tiny):
    got, engine = _tokens(tiny, quantization="fp8")
    want, dense = _tokens(tiny)
    assert engine.weight_bytes < dense.weight_bytes
    assert [t[0] for t in got] == [t[0] for t in want]  # e4m3 keeps 3 mantissa bits: the first token holds


def _corrupt(qdir, edit):
    sd = load_file(str(qdir / "model.safetensors"))
    edit(sd)
    save_file(sd, str(qdir / "model.safetensors"), metadata={"format": "pt"})


def test_broken_checkpoints_name_the_tensor(tiny, tmp_path):
    from quant_packers import pack_checkpoint

    name = "model.layers.1.mlp.down_proj"
    cases = [
        ("awq", {}, lambda sd: sd.pop(name + ".scales"), f"'{name}.scales': missing from the checkpoint"),
        ("awq", {}, lambda sd: sd.__setitem__(name + ".qweight", sd[name + ".qweight"][:, :-1].contiguous()),
         f"'{name}.scales': shape"),
        ("gptq", dict(act_order=True), lambda sd: sd.__setitem__(name + ".g_idx", sd[name + ".g_idx"][:-4].contiguous()),
         f"'{name}.g_idx': has 124 entries, expected one per input feature \\(128\\)"),
        ("gptq", {}, lambda sd: sd.__setitem__(name + ".qzeros", sd[name + ".qzeros"][:1].contiguous()),
         f"'{name}.qzeros': shape"),
    ]
    for i, (fmt, kw, edit, message) in enumerate(cases):
        qdir, _ = pack_checkpoint(tiny, tmp_path / str(i), fmt, **kw)
        _corrupt(qdir, edit)
        with pytest.raises(ConfigError, match=message):
            _tokens(qdir)
    # a group size the tensors do not have
    qdir, _ = pack_checkpoint(tiny, tmp_path / "g", "gptq", group=32)
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"'model.layers.0.self_attn.q_proj.scales': shape \(2, 64\), expected \(1, 64\)"):
        _tokens(qdir)


def test_unsupported_bits_and_contradicting_flag_are_one_line(tiny, tmp_path):
    from quant_packers import pack_checkpoint

    qdir, _ = pack_checkpoint(tiny, tmp_path, "gptq", bits=4, group=32)
    with pytest.raises(ConfigError, match="--quantization awq contradicts the checkpoint, which is quantized with gptq"):
        _tokens(qdir, quantization="awq")
    _tokens(qdir, quantization="gptq_marlin")  # vLLM's alias of the same format is accepted
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"GPTQ with 3-bit weights is not supported \(supported: 4 and 8 bit\)"):
        _tokens(qdir)
