"""Speculative decoding's configuration (flags, LLM keywords, clear errors) and its proposers' units."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hf_reference import hf_greedy
from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.spec.config import SpeculativeConfig
from pagedserve.spec.ngram import NgramProposer
from pagedserve.spec.suffix import SuffixProposer


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "unknown method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key(s) lookahead"),
    ('{"method": "ngram",', "not valid JSON"),
])
def test_bad_config_is_a_clear_error(value, words):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value) and "--speculative-config" in str(e.value)


def test_vllm_forms_are_accepted():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 4, 2)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24  # the tree depth


def test_draft_with_another_vocabulary_or_shorter_context_fails_at_start(llama_dir, tmp_path):
    from tiny_models import make_tiny_checkpoint

    other = make_tiny_checkpoint(tmp_path / "other-vocab", "llama", extra_config={"vocab_size": 400})
    with pytest.raises(ConfigError, match="another vocabulary than the target"):
        LLM(model=str(llama_dir), num_gpu_blocks_override=64,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    short = make_tiny_checkpoint(tmp_path / "short", "llama", max_position_embeddings=128)
    with pytest.raises(ConfigError, match="fewer than max_model_len=1024; use --max-model-len 128"):
        LLM(model=str(llama_dir), num_gpu_blocks_override=64,
            speculative_config={"method": "draft_model", "model": str(short), "num_speculative_tokens": 2})
    # within the draft's context it serves
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64, max_model_len=128, num_threads=1,
              speculative_model=str(short), num_speculative_tokens=2)
    assert llm.llm_engine.spec_decoder.method == "draft_model"


def _run(*args):
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))


def test_cli_flags(llama_dir):
    from transformers import AutoTokenizer

    r = _run("generate", "--model", str(llama_dir), "--prompt", "hi", "--speculative-config", '{"method": "x"}')
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown method 'x'" in r.stderr
    r = _run("generate", "--model", str(llama_dir), "--prompt", "hi", "--num-speculative-tokens", "3")
    assert r.returncode == 2 and "needs --speculative-model" in r.stderr
    prompt = "the cat and the cat and the cat and the"
    r = _run("generate", "--model", str(llama_dir), "--prompt", prompt, "--max-tokens", "16", "--ignore-eos",
             "--num-gpu-blocks-override", "64", "--speculative-model", "[ngram]", "--num-speculative-tokens", "3")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    assert r.stdout == tok.decode(hf_greedy(str(llama_dir), tuple(tok.encode(prompt)), 16), skip_special_tokens=True) + "\n"


def test_ngram_takes_the_latest_occurrence_of_the_longest_match():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.lookup([1, 2, 3, 9, 9, 7, 2, 3, 8, 5, 2, 3], 2) == [8, 5]  # "2 3" last seen before 8 5
    assert p.lookup([4, 1, 2, 3, 6, 1, 2, 3, 7, 0, 1, 2, 3], 3) == [7, 0, 1]  # "1 2 3": the latest one
    assert p.lookup([5, 6, 7], 2) == []
    assert p.lookup([5, 6, 5], 4) == [6, 5]


def test_suffix_proposes_the_frequent_continuation_and_learns_from_finished_outputs():
    p = SuffixProposer(max_tree_depth=8, max_cached_requests=2, min_token_prob=0.1)
    seq = SimpleNamespace(seq_id=1, token_ids=[1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2], prompt_len=3)
    assert p.propose([seq], [3]) == [[3, 4, 9]]
    seq.output_token_ids = seq.token_ids[3:]
    p.release(seq)
    fresh = SimpleNamespace(seq_id=2, token_ids=[50, 51, 4, 9], prompt_len=4)
    assert p.propose([fresh], [2]) == [[1, 2]]  # only the server-wide tree knows "4 9" -> "1 2"
    for i in range(3, 6):  # past the cap, the first output is forgotten (its counts subtracted)
        p.release(SimpleNamespace(seq_id=i, token_ids=[70 + i, 71], prompt_len=0, output_token_ids=[70 + i, 71]))
    assert p.propose([SimpleNamespace(seq_id=9, token_ids=[60, 4, 9], prompt_len=3)], [2]) == [[]]
    assert p.shared.root.children.keys() == {74, 75, 71}
