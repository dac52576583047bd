"""Builders for tiny random-weight Hugging Face checkpoints and an offline tokenizer.

Every test model is made here, in a temporary folder, with transformers' own config classes and
`save_pretrained`, so the reference (transformers) and pagedserve read exactly the same files.
Nothing touches the network.
"""
from __future__ import annotations

import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "Once upon a time there was a little girl who loved to play in the park with her dog.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Paged attention stores the key and value cache in fixed size blocks of tokens.",
    "Continuous batching lets new requests join the running batch at every step.",
    "What is the capital of France? The capital of France is Paris, a city on the Seine.",
    "Café, naïve, façade, 東京, 日本語, emoji 🙂🚀 and other multi-byte characters matter too.",
    "def hello(name): return 'Hello, ' + name + '!'  # code is text as well",
    "Numbers like 12345, 3.14159 and 2026 appear in many prompts and answers.",
]


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 384) -> "PreTrainedTokenizerFast":
    """Train a small byte-level BPE tokenizer offline and save it in HF format to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    init_std: float = 0.05,
    rope_theta: float = 10000.0,
    extra_config: dict | None = None,
) -> Path:
    """Write a tiny random-weight checkpoint (config.json, model.safetensors, tokenizer) to out_dir.

    arch: "llama" (untied, GQA), "qwen2" (q/k/v biases, tied embeddings by default) or "mistral".
    A larger init_std than HF's 0.02 keeps logits peaked, so greedy choices are far from ties.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_theta=rope_theta,
    )
    common.update(extra_config or {})
    if arch == "llama":
        cfg = LlamaConfig(tie_word_embeddings=bool(tie_word_embeddings), **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
            use_sliding_window=False,
            **common,
        )
        cls = Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = MistralConfig(**{"tie_word_embeddings": bool(tie_word_embeddings), "sliding_window": None, **common})
        cls = MistralForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    # HF zero-initialises biases; give Qwen2's q/k/v biases real values so the test covers them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, init_std)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
