"""Write a llama.cpp-style GGUF from a tiny Hugging Face Llama checkpoint, for the GGUF loader's tests.

It does what llama.cpp's converter does for a Llama model, written here from the format description:
HF names become GGUF names, the q/k rows of each head are reordered for llama.cpp's RoPE layout, 2-D
weights are optionally quantized (1-D norms stay F32, as llama.cpp keeps them), and the byte-level BPE
vocabulary, merges, special-token ids and chat template go into the metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves (2, d/2) become interleaved (d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.{i}.<module...>.weight
    i, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{i}.{_BLOCK[module]}.{kind}"


def write_gguf_from_hf(hf_dir, out_path, qtype=None, *, arch: str = "llama", override_types: dict | None = None) -> Path:
    """Write `out_path` (a GGUF) from the HF Llama checkpoint in `hf_dir`.

    qtype: a gguf.GGMLQuantizationType for the 2-D weights (default F32). override_types: GGUF tensor
    name -> type, for single tensors (used to plant an unsupported type).
    """
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    override_types = override_types or {}
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_vocab_size(cfg["vocab_size"])

    # byte-level BPE vocabulary: the tokens are already spelled in the byte alphabet
    vocab = tok["model"]["vocab"]
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    for i, t in added.items():
        tokens[i] = t["content"]
    assert all(t is not None for t in tokens)
    types = [3 if (i in added and added[i]["special"]) else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_unk_token_id(vocab.get("<unk>", 0) if "<unk>" in vocab else tokens.index("<unk>"))
    w.add_pad_token_id(0xFFFFFFFF)  # "no pad token", spelled the way llama2.c-converted files spell it
    w.add_add_bos_token(True)
    template = tok_cfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)

    sd = load_file(str(hf_dir / "model.safetensors"))
    for name, arr in sd.items():
        arr = arr.astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = llamacpp_permute(arr, n_head)
        elif name.endswith("k_proj.weight"):
            arr = llamacpp_permute(arr, n_kv)
        gname = gguf_name(name)
        t = override_types.get(gname, qtype if arr.ndim == 2 else gguf.GGMLQuantizationType.F32)
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, np.ascontiguousarray(arr))
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, np.ascontiguousarray(arr.astype(np.float16)))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, t), raw_dtype=t)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
