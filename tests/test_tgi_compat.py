"""TGI compatibility, end to end: a real `pagedserve serve` started with TGI's launcher flags,
driven by huggingface_hub's InferenceClient (the client TGI users have) and raw httpx."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_utils import RemoteServer, metric

hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import InferenceClient  # noqa: E402
from huggingface_hub.errors import OverloadedError, ValidationError  # noqa: E402

PROMPT = "Once upon a time there was"
TGI_FLAGS = ["--max-total-tokens", 256, "--max-batch-prefill-tokens", 512, "--num-shard", 1,
             "--max-input-tokens", 64, "--max-concurrent-requests", 3, "--tgi-metrics"]


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = RemoteServer(None, ["--model-id", llama_dir, *TGI_FLAGS, "--num-gpu-blocks-override", 96,
                              "--num-threads", 1, "--seed", 0, "--disable-log-requests"])
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return InferenceClient(model=server.base_url, timeout=60)


def openai_greedy(server, prompt: str, max_tokens: int) -> str:
    r = httpx.post(server.url("/v1/completions"), json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0.0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_launcher_aliases_and_info(server):
    info = httpx.get(server.url("/info"), timeout=10).json()
    assert info["max_total_tokens"] == 256  # --max-total-tokens → --max-model-len
    assert info["max_batch_prefill_tokens"] == 512  # --max-batch-prefill-tokens → --max-num-batched-tokens
    assert info["max_input_tokens"] == 64 and info["max_concurrent_requests"] == 3
    assert info["model_pipeline_tag"] == "text-generation" and info["model_device_type"] == "cpu"
    assert info["pagedserve_config"]["max_model_len"] == 256
    models = httpx.get(server.url("/v1/models"), timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 256


def test_text_generation_greedy_matches_openai_route(server, client):
    text = client.text_generation(PROMPT, max_new_tokens=12)
    assert isinstance(text, str) and text
    assert text == openai_greedy(server, PROMPT, 12)
    full = client.text_generation(PROMPT, max_new_tokens=12, return_full_text=True)
    assert full == PROMPT + text


def test_details_prefill_and_top_tokens(server, client):
    out = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True,
                                 top_n_tokens=3)
    d = out.details
    prompt_ids = httpx.post(server.url("/tokenize"), json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    assert [t.id for t in d.prefill] == prompt_ids
    assert d.prefill[0].logprob is None and all(t.logprob <= 0 for t in d.prefill[1:])
    assert d.generated_tokens == len(d.tokens) and d.finish_reason in ("length", "eos_token")
    assert d.seed is None  # greedy
    assert "".join(t.text for t in d.tokens if not t.special) == out.generated_text
    assert len(d.top_tokens) == len(d.tokens)
    for tok, top in zip(d.tokens, d.top_tokens):  # the client leaves these as dicts
        assert len(top) == 3 and top[0]["id"] == tok.id  # greedy picks the most likely token
        assert top[0]["logprob"] == pytest.approx(tok.logprob, abs=1e-5)
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]


def test_streaming_matches_non_streaming(client):
    whole = client.text_generation(PROMPT, max_new_tokens=10, details=True)
    pieces = list(client.text_generation(PROMPT, max_new_tokens=10, stream=True))
    events = list(client.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert "".join(e.token.text for e in events if not e.token.special) == whole.generated_text
    assert "".join(pieces) == "".join(e.token.text for e in events)
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == whole.generated_text
    assert events[-1].details.finish_reason == whole.details.finish_reason
    assert events[-1].details.generated_tokens == whole.details.generated_tokens


def test_stop_sequence_and_seeded_sampling(client):
    base = client.text_generation(PROMPT, max_new_tokens=12, details=True)
    stop = base.generated_text[4:7]
    assert stop.strip(), base.generated_text
    out = client.text_generation(PROMPT, max_new_tokens=12, stop=[stop], details=True)
    assert out.details.finish_reason == "stop_sequence"
    assert out.generated_text.endswith(stop) and len(out.generated_text) < len(base.generated_text)
    a = client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, temperature=1.5, seed=7, details=True)
    b = client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, temperature=1.5, seed=7, details=True)
    assert a.generated_text == b.generated_text and a.details.seed == 7


def test_bad_and_unsupported_fields_are_tgi_validation_errors(server, client):
    with pytest.raises(ValidationError, match="temperature"):
        client.text_generation(PROMPT, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValidationError, match="grammar"):
        client.text_generation(PROMPT, max_new_tokens=4, grammar={"type": "regex", "value": "[ab]+"})
    with pytest.raises(ValidationError, match="watermark"):
        client.text_generation(PROMPT, max_new_tokens=4, watermark=True)
    for body, needle in (({"inputs": PROMPT, "parameters": {"nope": 1}}, "parameters.nope"),
                         ({"inputs": ""}, "inputs"),
                         ({"inputs": PROMPT, "parameters": {"max_new_tokens": 500}}, "max_new_tokens"),
                         ({"inputs": PROMPT, "parameters": {"decoder_input_details": True}}, "details")):
        r = httpx.post(server.url("/generate"), json=body, timeout=30)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation" and needle in r.json()["error"], r.json()
    r = httpx.post(server.url("/generate_stream"), json={"inputs": PROMPT, "parameters": {
        "details": True, "decoder_input_details": True}}, timeout=30)
    assert r.status_code == 422 and "streaming" in r.json()["error"]


def test_max_input_tokens_applies_to_tgi_and_openai_routes(server):
    long_prompt = " ".join(["Once upon a time"] * 12)  # ~120 tokens: above 64, within 256
    r = httpx.post(server.url("/generate"), json={"inputs": long_prompt}, timeout=30)
    assert r.status_code == 422 and "64" in r.json()["error"], r.text
    r = httpx.post(server.url("/v1/completions"), json={"prompt": long_prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "--max-input-tokens" in r.json()["error"]["message"], r.text
    # `truncate` keeps the last tokens, so the same prompt fits
    r = httpx.post(server.url("/generate"), json={"inputs": long_prompt, "parameters": {
        "truncate": 32, "max_new_tokens": 2, "details": True}}, timeout=30)
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 2, r.text


def test_concurrency_limit_and_tgi_metric_names(server, client):
    before = server.metrics()
    opened, release = threading.Barrier(4), threading.Event()
    results = []

    def hold_stream():
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 200}}
        with httpx.stream("POST", server.url("/generate_stream"), json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            results.append(json.loads(first[5:])["index"])
            opened.wait()
            release.wait(30)  # closing the stream aborts the request

    threads = [threading.Thread(target=hold_stream) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        opened.wait(60)
        with pytest.raises(OverloadedError):
            client.text_generation(PROMPT, max_new_tokens=2)
        r = httpx.post(server.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200  # never limited
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert results == [1, 1, 1]
    deadline = time.monotonic() + 30
    while True:  # the closed streams leave the limit once the server has seen the disconnects
        try:
            client.text_generation(PROMPT, max_new_tokens=3)
            break
        except OverloadedError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    after = server.metrics()
    grew = metric(after, "tgi_request_count") - metric(before, "tgi_request_count")
    assert grew == 4  # three aborted streams and one success; the 429s never reached the engine
    assert metric(after, "tgi_request_success") - metric(before, "tgi_request_success") == 1
    assert metric(after, "tgi_request_failure", err="aborted") - metric(before, "tgi_request_failure",
                                                                         err="aborted") == 3
    assert metric(after, "tgi_request_duration_count") == metric(after, "pagedserve:e2e_request_latency_seconds_count")
    assert metric(after, "tgi_request_generated_tokens_count") > 0
    assert ("tgi_queue_size", frozenset()) in after and ("tgi_batch_current_size", frozenset()) in after


def test_tgi_flags_map_onto_engine_flags_and_bad_values_fail_before_loading():
    from pagedserve.cli import build_parser
    from pagedserve.config import EngineConfig
    from pagedserve.errors import ConfigError
    from pagedserve.server.tgi.launcher_args import check_tgi_args

    args = build_parser("serve").parse_args(["serve", "--model-id", "x", "--max-input-tokens", "300",
                                              "--max-total-tokens", "256", "--max-batch-size", "4",
                                              "--cuda-memory-fraction", "0.5", "--hostname", "0.0.0.0"])
    assert (args.model, args.max_model_len, args.max_num_seqs, args.gpu_memory_utilization, args.host) == \
        ("x", 256, 4, 0.5, "0.0.0.0")
    with pytest.raises(ConfigError, match="--max-input-tokens 255"):
        EngineConfig(max_input_tokens=args.max_input_tokens, max_model_len=args.max_model_len).resolve(512)
    args = build_parser("serve").parse_args(["serve", "--max-concurrent-requests", "0"])
    assert check_tgi_args(args) == "--max-concurrent-requests must be >= 1"
