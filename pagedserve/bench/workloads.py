"""The standard offline workloads (W1, W2, W3) and benchmark models (small, medium).

Definitions as described in benchmarks/README.md: prompt token ids drawn uniformly from [3, 32000)
with numpy.random.default_rng(0), greedy, EOS ignored so every request produces its length.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 32000


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, num_prompts: int | None = None) -> Workload:
    rng = np.random.default_rng(0)
    name = name.upper()
    if name == "W1":
        n = 256
        prompts = rng.integers(3, VOCAB, size=(n, 128)).tolist()
        outs = [128] * n
    elif name == "W2":
        n = 200
        in_lens = rng.integers(16, 1025, size=n)
        outs = rng.integers(16, 257, size=n).tolist()
        prompts = [rng.integers(3, VOCAB, size=int(k)).tolist() for k in in_lens]
    elif name == "W3":
        n = 128
        prefix = rng.integers(3, VOCAB, size=1024).tolist()
        suffixes = rng.integers(3, VOCAB, size=(n, 32)).tolist()
        prompts = [prefix + s for s in suffixes]
        outs = [64] * n
    else:
        raise ValueError(f"unknown workload {name!r}: use W1, W2 or W3")
    if num_prompts is not None:
        prompts, outs = prompts[:num_prompts], outs[:num_prompts]
    return Workload(name, prompts, outs)


MODEL_SHAPES = {
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=8),
}


def bench_model_dir(name: str) -> Path:
    """The folder of a standard benchmark model, built (random weights, seed 0) on first use."""
    from pagedserve.config import cache_dir

    root = Path(cache_dir()) / "bench-models"
    out = root / name
    if not (out / "model.safetensors").exists():
        build_bench_model(name, out)
    return out


def _word_tokenizer(out: Path) -> None:
    """A 32000-entry word-level tokenizer: random ids must decode to something, nothing more."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))


def build_bench_model(name: str, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown benchmark model {name!r}: use {', '.join(MODEL_SHAPES)} or a path")
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, **MODEL_SHAPES[name])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    _word_tokenizer(out)
