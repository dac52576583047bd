"""Real pretrained models through the public API (`LLM`).

- stories260K (../shared, skipped where absent): the HF folder and the llama.cpp GGUF both give
  llama2.c's documented greedy text.
- SmolLM2-135M-Instruct, the embedded default GGUF (Q4_1, dequantized to float32): greedy output is
  token-identical to transformers loading the same GGUF, raw and through the chat template, and it
  knows the capital of France.
"""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams

# CPU threads for the engine (and so for torch in this process); unset: the engine's default
THREADS = int(os.environ.get("PAGEDSERVE_TEST_THREADS", "0")) or None

STORIES_PROMPT = "Once upon a time"
STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_GOLDEN = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
    "a big, red ball. She wanted to play with it, but it was too high.\nLily"
)


def _golden_from_readme(shared_models) -> str:
    """The golden text as ../shared/models/README.md prints it (an indented block, 4 spaces)."""
    lines = (shared_models / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    Once upon a time"))
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block)


@pytest.mark.parametrize("name", ["stories260K", "stories260K.gguf"])
def test_stories260k_golden_text(shared_models, name):
    assert _golden_from_readme(shared_models) == STORIES_GOLDEN
    # the GGUF says 2048 tokens of context: cap the KV pool instead of sizing it for 4 GiB
    llm = LLM(model=str(shared_models / name), dtype="float32", num_gpu_blocks_override=256, num_threads=THREADS)
    assert llm.get_tokenizer().encode(STORIES_PROMPT) == STORIES_PROMPT_IDS
    out = llm.generate(STORIES_PROMPT, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == STORIES_PROMPT_IDS
    assert len(out.outputs[0].token_ids) == 60 and out.outputs[0].finish_reason == "length"
    assert out.prompt + out.outputs[0].text == STORIES_GOLDEN
    # the same through explicit token ids
    out2 = llm.generate({"prompt_token_ids": STORIES_PROMPT_IDS},
                        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert out2.outputs[0].token_ids == out.outputs[0].token_ids


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, the embedded default model

RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
CHAT_MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smol_path():
    from pagedserve.default_model import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(f"the default model is not installed ({e})")


@pytest.fixture(scope="module")
def smol_llm(smol_path):
    return LLM(model=str(smol_path), dtype="float32", max_model_len=512, num_gpu_blocks_override=128, num_threads=THREADS)


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32)
    model.eval()
    return tok, model


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored: exactly n tokens."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                             top_k=None)
    return out[0, x.shape[1]:].tolist()


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


@pytest.mark.slow
def test_smollm2_raw_prompts_match_transformers(smol_llm, smol_hf):
    tok, model = smol_hf
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = smol_llm.generate(RAW_PROMPTS, sp)  # one batch: the engine's batched path
    for prompt, out in zip(RAW_PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids, prompt
        ref = _hf_greedy(model, ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref, (prompt, out.outputs[0].text, tok.decode(ref))


@pytest.mark.slow
def test_smollm2_chat_matches_transformers(smol_llm, smol_hf):
    tok, model = smol_hf
    eos = set(smol_llm.llm_engine.eos_ids)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    convs = [[{"role": "user", "content": m}] for m in CHAT_MESSAGES]
    convs.append([{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Name a primary colour."}])
    outs = smol_llm.chat(convs, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for conv, out in zip(convs, outs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids, conv
        ref = _hf_greedy(model, ids, NEW_TOKENS)
        got = out.outputs[0].token_ids
        # we stop at the end-of-turn token; transformers (EOS ignored) ran on: compare up to it
        assert _until_eos(got, eos) == _until_eos(ref, eos), (conv, out.outputs[0].text, tok.decode(ref))
        if out.outputs[0].finish_reason == "stop":
            assert len(_until_eos(ref, eos)) < len(ref)  # transformers reached the same stop token
        else:
            assert len(got) == NEW_TOKENS


@pytest.mark.slow
def test_smollm2_knows_paris(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
