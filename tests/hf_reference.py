"""Reference outputs from Hugging Face transformers on the same weights (cached per process)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    m.eval()
    return m


@functools.lru_cache(maxsize=4096)
def hf_greedy(model_dir: str, prompt_ids: tuple, max_new_tokens: int, dtype: str = "float32") -> list[int]:
    """Greedy continuation with EOS ignored (exactly max_new_tokens tokens)."""
    m = hf_model(model_dir, dtype)
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def hf_logprobs(model_dir: str, token_ids: list[int], dtype: str = "float32") -> torch.Tensor:
    """log_softmax of the logits at every position of token_ids: [len, vocab]."""
    m = hf_model(model_dir, dtype)
    with torch.no_grad():
        logits = m(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
