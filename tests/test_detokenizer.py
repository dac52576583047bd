"""Streaming text: deltas never split a multi-byte character; joined deltas equal the final text."""
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


def _stream(tok, prompt_ids, out_ids, stops=(), include=False):
    d = IncrementalDetokenizer(tok, prompt_ids, list(stops), include)
    ids = list(prompt_ids)
    seen = ""
    deltas = []
    for i, t in enumerate(out_ids):
        ids.append(t)
        d.add_tokens(ids)
        vis = d.visible_text(finished=(i == len(out_ids) - 1) or d.stopped_on is not None)
        assert vis.startswith(seen), "text already shown must never change"
        deltas.append(vis[len(seen):])
        seen = vis
        if d.stopped_on:
            break
    return deltas, d


def test_multibyte_characters_are_never_split(tok):
    text = " Café 東京 emoji 🙂🚀 naïve façade 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    byte_tokens = sum(1 for i in ids if "\ufffd" in tok.decode([i]))
    assert byte_tokens > 0, "the text must contain tokens that are partial characters"
    deltas, _ = _stream(tok, tok.encode("Hello"), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_is_held_back_and_cut(tok):
    text = " the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, d = _stream(tok, tok.encode("Hi"), ids, stops=["fox jum"])
    assert "".join(deltas) == " the quick brown "
    assert d.stopped_on == "fox jum"
    deltas, _ = _stream(tok, tok.encode("Hi"), ids, stops=["fox jum"], include=True)
    assert "".join(deltas) == " the quick brown fox jum"


def test_engine_stream_deltas_join_to_final_text(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=64)
    eng = llm.llm_engine
    eng.add_request("s", "Café 東京", SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True))
    shown = ""
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            text = o.outputs[0].text
            assert text.startswith(shown)
            shown = text
            final = o
    assert final.finished and shown == llm.get_tokenizer().decode(final.outputs[0].token_ids, skip_special_tokens=True)


def test_trailing_partial_character_is_flushed_at_the_end(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok, tok.encode("Hi"), [], False)
    full = tok.encode("Hi") + ids[:1]
    d.add_tokens(full)
    assert d.visible_text(False) == ""
    d.flush(full)
    assert d.visible_text(True) == tok.decode(ids[:1]) and "\ufffd" in d.text


def test_fast_decode_matches_transformers_decode(tok):
    import random

    from pagedserve.engine.detokenizer import fast_decode

    dec = fast_decode(tok)
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for n in (1, 2, 7, 40):
        for _ in range(30):
            ids = [rng.randrange(tok.vocab_size) for _ in range(n)] + rng.sample(specials, min(2, len(specials)))
            rng.shuffle(ids)
            for skip in (True, False):
                assert dec(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_fast_decode_keeps_transformers_when_it_cleans_up_spaces(tok, monkeypatch):
    from pagedserve.engine.detokenizer import fast_decode

    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True, raising=False)
    assert fast_decode(tok) == tok.decode
