"""`pagedserve eval perplexity`: our model code's perplexity against transformers computing the same thing.

The reference below is written independently of pagedserve.eval.perplexity: transformers' forward on
each window, log_softmax, and the NLL of the scored next tokens (window positions 1..len-1; with
stride < window only the tokens past the previous window's end, the usual sliding-window recipe).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from pagedserve import LLM
from pagedserve.eval.perplexity import evaluate, make_windows

THREADS = int(os.environ.get("PAGEDSERVE_TEST_THREADS", "0")) or None
SHARED_TEXT = "tinystories-valid-sample.txt"


def hf_perplexity(model_dir, token_ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """(perplexity, scored tokens) with transformers' model, reference implementation."""
    from hf_reference import hf_model

    model = hf_model(str(model_dir))
    nll_sum, count, prev_end = 0.0, 0, 0
    for start in range(0, len(token_ids), stride):
        end = min(start + window, len(token_ids))
        ids = torch.tensor([token_ids[start:end]])
        n_new = end - max(prev_end, start + 1)  # tokens not scored by an earlier window
        if n_new > 0:
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            targets = ids[0, 1:]
            nll = -logp[:-1].gather(1, targets[:, None]).squeeze(1)
            nll_sum += nll[-n_new:].sum().item()
            count += n_new
        prev_end = end
        if end == len(token_ids):
            break
    return math.exp(nll_sum / count), count


def _run_cli(*args, timeout=300):
    if THREADS:
        args = (*args, "--num-threads", str(THREADS))
    return subprocess.run([sys.executable, "-m", "pagedserve", "eval", "perplexity", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_make_windows():
    w = make_windows(10, 4, 4)
    assert [(x.start, x.end, x.first_scored) for x in w] == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert sum(x.end - x.first_scored for x in w) == 10 - 3  # each window's first token is context only
    w = make_windows(10, 4, 2)  # overlapping: every token after the first is scored exactly once
    assert [(x.start, x.end, x.first_scored) for x in w] == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert sum(x.end - x.first_scored for x in w) == 9
    assert [(x.start, x.end) for x in make_windows(9, 4, 4)] == [(0, 4), (4, 8)]  # a 1-token tail scores nothing
    with pytest.raises(ValueError):
        make_windows(10, 4, 5)
    with pytest.raises(ValueError):
        make_windows(10, 1, 1)


# ------------------------------------------------------------------------------------------------
# stories260K on held-out TinyStories text (../shared)


@pytest.fixture(scope="module")
def stories_llm(shared_models):
    return LLM(model=str(shared_models / "stories260K"), dtype="float32", num_gpu_blocks_override=256, num_threads=THREADS)


def test_stories_perplexity_matches_transformers(shared_models, stories_llm):
    text_file = shared_models.parent / "data" / SHARED_TEXT
    if not text_file.is_file():
        pytest.skip(f"{text_file} is not present")
    text = text_file.read_text(encoding="utf-8")
    res = evaluate(stories_llm, text)
    assert res.window == 511 and res.stride == 511  # the HF copy's context is 512: one token is left to generate
    ids = stories_llm.get_tokenizer().encode(text, verbose=False)
    assert res.num_tokens == len(ids) and ids[0] == 1 and ids.count(1) == 1  # one BOS, at the start of the file
    ref, n_ref = hf_perplexity(shared_models / "stories260K", ids, 511, 511)
    assert res.num_scored_tokens == n_ref == len(ids) - res.num_windows
    assert res.perplexity == pytest.approx(ref, rel=5e-3)
    assert res.perplexity == pytest.approx(ref, rel=1e-4)  # in fact fp32 agrees far closer than 0.5 %
    assert 5.3 < res.perplexity < 5.8  # about 5.55


# ------------------------------------------------------------------------------------------------
# a tiny random model and a text written here (runs on any clone)

TINY_TEXT = (
    "Once upon a time there was a little girl who loved to play in the park with her dog. "
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.\n"
    "Paged attention stores the key and value cache in fixed size blocks of tokens. "
    "What is the capital of France? The capital of France is Paris, a city on the Seine.\n"
) * 4


@pytest.fixture(scope="module")
def tiny_llm(llama_dir):
    return LLM(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, num_threads=THREADS)


@pytest.mark.parametrize("window,stride", [(64, 64), (64, 40), (300, 300)])
def test_tiny_perplexity_matches_transformers(llama_dir, tiny_llm, window, stride):
    res = evaluate(tiny_llm, TINY_TEXT, window=window, stride=stride)
    ids = tiny_llm.get_tokenizer().encode(TINY_TEXT)
    assert res.num_tokens == len(ids) > window
    ref, n_ref = hf_perplexity(llama_dir, ids, window, stride)
    assert res.num_scored_tokens == n_ref
    assert res.perplexity == pytest.approx(ref, rel=1e-4)
    assert 1.0 < res.perplexity < 2 * len(tiny_llm.get_tokenizer())


def test_tiny_window_too_long(tiny_llm):
    with pytest.raises(ValueError, match="--window"):
        evaluate(tiny_llm, TINY_TEXT, window=tiny_llm.llm_engine.config.max_model_len)


def test_cli_json_and_errors(llama_dir, tiny_llm, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TINY_TEXT, encoding="utf-8")
    r = _run_cli("--model", str(llama_dir), "--text", str(f), "--window", "64", "--dtype", "float32",
                 "--num-gpu-blocks-override", "64", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    want = evaluate(tiny_llm, TINY_TEXT, window=64)
    assert got["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)
    assert got["num_scored_tokens"] == want.num_scored_tokens and got["window"] == got["stride"] == 64

    r = _run_cli("--model", str(llama_dir), "--text", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "missing.txt" in r.stderr
    r = _run_cli("--model", str(llama_dir), "--text", str(f), "--window", "5000", "--num-gpu-blocks-override", "64")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--window" in r.stderr, r.stderr
