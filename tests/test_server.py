"""The OpenAI-compatible server, end to end: a real `pagedserve serve` subprocess on 127.0.0.1
with the tiny random Llama, driven by the official `openai` client (sync and async) and httpx.

One main server for the module (the SIGTERM test runs last and ends it) and a second one with
--api-key and --max-num-queued-reqs 0 for auth and admission control.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_utils import REPO, RemoteServer, metric

MAX_MODEL_LEN = 256
ENGINE_ARGS = ["--max-model-len", MAX_MODEL_LEN, "--num-gpu-blocks-override", 128, "--block-size", 16,
               "--num-threads", 1, "--seed", 0]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
PROMPT = "Once upon a time there was"
KEY = "test-secret-key"

PROMPTS = [
    "Once upon a time", "The quick brown fox", "Paged attention stores", "Continuous batching lets",
    "What is the capital of France?", "def hello(name):", "Numbers like 12345", "Café, naïve, façade",
    "The cat sleeps", "a little girl who loved", "key and value cache", "new requests join",
    "Paris, a city on", "emoji 🙂🚀 and", "code is text", "3.14159 and 2026",
]
PROMPTS = PROMPTS + [p + " again" for p in PROMPTS]  # 32


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = RemoteServer(llama_dir, [*ENGINE_ARGS, "--shutdown-timeout", 20],
                       env={"PAGEDSERVE_SSE_PING_SECONDS": "0.2"})
    # start the second server now too: both load while the first tests run
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(llama_dir):
    srv = RemoteServer(llama_dir, [*ENGINE_ARGS, "--api-key", KEY, "--max-num-queued-reqs", 0,
                                   "--disable-log-requests"], api_key=KEY)
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def offline(llama_dir):
    from pagedserve import LLM

    return LLM(model=str(llama_dir), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=128, block_size=16,
               num_threads=1, seed=0)


def offline_greedy(llm, prompt: str, max_tokens: int) -> str:
    from pagedserve import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].text


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__"):
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------------------------------------
def test_health_models_version_tokenize(server):
    assert httpx.get(server.url("/health")).status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [str(server_model(server))]
    assert httpx.get(server.url("/version")).json()["version"]
    tok = httpx.post(server.url("/tokenize"), json={"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(server.url("/detokenize"), json={"tokens": tok["tokens"]}).json()
    assert PROMPT in detok["prompt"]
    chat_tok = httpx.post(server.url("/tokenize"),
                          json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 0


def server_model(server) -> str:
    return httpx.get(server.url("/v1/models")).json()["data"][0]["id"]


def test_completion_greedy_stream_equals_nonstream_equals_offline(server, offline):
    c = server.client()
    model = server_model(server)
    full = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY)
    ch = full.choices[0]
    assert ch.finish_reason == "length"
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(x.choices[0].text for x in chunks if x.choices)
    finals = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert streamed == ch.text
    assert ch.text == offline_greedy(offline, PROMPT, 24)


def test_chat_stream_and_nonstream(server, offline):
    from pagedserve import SamplingParams

    c = server.client()
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Japan?"}]
    full = c.chat.completions.create(model=server_model(server), messages=messages, max_tokens=16, **GREEDY)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16

    chunks = list(c.chat.completions.create(model=server_model(server), messages=messages, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    reasons = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert reasons == ["length"]
    last_with_choice = max(i for i, x in enumerate(chunks) if x.choices)
    assert chunks[last_with_choice].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert content == msg.content

    ref = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert ref[0].outputs[0].text == msg.content
    assert full.usage.prompt_tokens == len(ref[0].prompt_token_ids)


def test_n2_stop_and_logprobs(server):
    c = server.client()
    model = server_model(server)
    # n=2 sampled
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=1,
                             extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    rc = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
                                   temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in rc.choices) == [0, 1]
    # streamed n=2: both indexes get a finish_reason
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=2, stream=True, **GREEDY))
    texts = {0: "", 1: ""}
    for x in chunks:
        for ch in x.choices:
            texts[ch.index] += ch.text
    assert sum(1 for x in chunks for ch in x.choices if ch.finish_reason) == 2
    assert texts[0] == texts[1]  # greedy: identical choices

    # stop string: cut the greedy text before a substring of it
    base = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = next(base[i:i + 2] for i in range(3, len(base) - 2) if base[i:i + 2].strip() and "\ufffd" not in base[i:i + 2])
    cut = base[:base.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=24, stop=[stop], stream=True,
                                               **GREEDY))
            text = "".join(x.choices[0].text for x in chunks if x.choices)
            reason = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason][0]
        else:
            ch = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, stop=stop, **GREEDY).choices[0]
            text, reason = ch.text, ch.finish_reason
        assert reason == "stop" and text == cut, (stream, stop, text, cut)

    # completion logprobs (OpenAI legacy format)
    ch = c.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY).choices[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # greedy: the chosen token is the most likely one
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val == pytest.approx(max(top.values()), abs=1e-4)
    # echo + logprobs: prompt tokens come first, the first with no logprob
    e = c.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, **GREEDY).choices[0]
    assert e.text.startswith(PROMPT) and e.logprobs.token_logprobs[0] is None
    # streamed logprobs carry one entry per token
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=2, stream=True, **GREEDY))
    assert sum(len(x.choices[0].logprobs.tokens) for x in chunks if x.choices and x.choices[0].logprobs) == 6

    # chat logprobs (chat format)
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                  logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and isinstance(t.bytes, list)
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=5, logprobs=True, top_logprobs=1, stream=True, **GREEDY))
    assert sum(len(x.choices[0].logprobs.content) for x in chunks
               if x.choices and x.choices[0].logprobs and x.choices[0].logprobs.content) == 5


def test_32_concurrent_streaming_clients(server, offline):
    max_tokens = 12
    refs = [offline_greedy(offline, p, max_tokens) for p in PROMPTS]  # sequential greedy reference
    model = server_model(server)

    async def one(client, prompt):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 **GREEDY)
        text, reason = "", None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                reason = ch.finish_reason or reason
        return text, reason

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(main())
    assert [r[1] for r in results] == ["length"] * len(PROMPTS)
    assert [r[0] for r in results] == refs


def _wait_idle(server, timeout=5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (metric(m, "pagedserve:kv_cache_usage_perc") == 0 and metric(m, "pagedserve:num_requests_running") == 0
                and metric(m, "pagedserve:num_requests_waiting") == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: kv={metric(m, 'pagedserve:kv_cache_usage_perc')}"
                                 f" running={metric(m, 'pagedserve:num_requests_running')}")
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_kv(server):
    model = server_model(server)
    before = _wait_idle(server)
    aborts0 = metric(before, "pagedserve:request_success_total", finished_reason="abort")
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 20, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url("/v1/completions"), json=body) as r:
            assert r.status_code == 200
            it = r.iter_lines()  # keep a reference: dropping the iterator closes the connection
            n = 0
            for line in it:
                if line.startswith("data: "):
                    n += 1
                    if n == 3:
                        break
            m = server.metrics()
            assert metric(m, "pagedserve:kv_cache_usage_perc") > 0
            assert metric(m, "pagedserve:num_requests_running") == 1
            r.close()  # the client goes away mid-stream
    after = _wait_idle(server)
    assert metric(after, "pagedserve:request_success_total", finished_reason="abort") == aborts0 + 1

    # non-streamed: the client gives up (timeout) → the request is aborted too
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=0.02)  # the engine finishes the whole request in ~0.3 s now
    after2 = _wait_idle(server)
    assert metric(after2, "pagedserve:request_success_total", finished_reason="abort") == aborts0 + 2
    # still serving
    assert server.client().completions.create(model=model, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_bad_inputs_are_400_in_openai_shape(server):
    url = server.url("/v1/completions")
    curl = server.url("/v1/chat/completions")
    model = server_model(server)
    vocab_huge = 10**6
    cases = [
        (url, {"prompt": ""}, 400, "prompt"),
        (url, {"prompt": []}, 400, "prompt"),
        (url, {"prompt": [1, vocab_huge]}, 400, "prompt"),
        (url, {"prompt": [-1]}, 400, "prompt"),
        (url, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (url, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        (url, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        (url, {"prompt": "hi", "n": 0}, 400, "n"),
        (url, {"prompt": "hi", "seed": 2**70, "temperature": 1.0}, 400, "seed"),
        (url, {"prompt": "hi", "temperature": "nan"}, 400, "temperature"),
        (url, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
        (url, {"prompt": "hi", "logprobs": 1000}, 400, "logprobs"),
        (url, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        (url, {"prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
        (url, {"prompt": {"not": "a prompt"}}, 400, "prompt"),
        (url, {"max_tokens": 3}, 400, "prompt"),
        (url, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        (url, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
        (url, {"prompt": "hi", "stream": True, "temperature": -1}, 400, "temperature"),
        (curl, {"messages": []}, 400, "messages"),
        (curl, {"messages": [{"content": "no role"}]}, 400, "messages"),
        (curl, {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        (curl, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
        (curl, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        (curl, {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ]
    for u, body, status, param in cases:
        if "model" not in body:
            body = {"model": model, **body}
        r = httpx.post(u, json=body, timeout=30)
        assert_error(r, status, param)
    assert_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(httpx.get(server.url("/no/such/route")), 404)
    # the official client maps them to its exception types
    c = server.client()
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=model, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    # and the server still answers
    ok = c.completions.create(model=model, prompt="hi", max_tokens=3, **GREEDY)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3


def test_metrics_counters_move_by_known_amounts(server):
    c = server.client()
    model = server_model(server)
    m0 = _wait_idle(server)
    r1 = c.completions.create(model=model, prompt=PROMPT, max_tokens=5, **GREEDY)
    r2 = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=7, **GREEDY)
    chunks = list(c.completions.create(model=model, prompt="The quick brown fox", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    u3 = chunks[-1].usage
    m1 = _wait_idle(server)

    def d(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    assert d("pagedserve:prompt_tokens_total") == r1.usage.prompt_tokens + r2.usage.prompt_tokens + u3.prompt_tokens
    assert d("pagedserve:generation_tokens_total") == 5 + 7 + 4
    assert d("pagedserve:request_success_total", finished_reason="length") == 3
    assert d("pagedserve:request_success_total", finished_reason="abort") == 0
    assert d("pagedserve:e2e_request_latency_seconds_count") == 3
    assert d("pagedserve:time_to_first_token_seconds_count") == 3
    assert d("pagedserve:request_generation_tokens_sum") == 16
    assert d("pagedserve:inter_token_latency_seconds_count") == (5 - 1) + (7 - 1) + (4 - 1)
    assert d("pagedserve:iteration_tokens_total_count") > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "admission_rejections_total", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "request_prompt_tokens_count"):
        assert any(n == "pagedserve:" + name for n, _ in m1), name
    assert d("pagedserve:prefix_cache_queries_total") > 0


def test_api_key_and_queue_limit(keyed_server):
    srv = keyed_server
    url = srv.url("/v1/completions")
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(url, json=body), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(srv.url("/v1/models"), headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url("/v1"), api_key="wrong", max_retries=0).models.list()
    # open routes
    assert httpx.get(srv.url("/health")).status_code == 200
    assert httpx.get(srv.url("/metrics")).status_code == 200
    # the right key passes auth
    assert srv.client().models.list().data[0].id
    m0 = srv.metrics()
    # --max-num-queued-reqs 0: every generation is turned away with 503 + Retry-After
    r = httpx.post(url, json=body, headers=srv.headers)
    assert_error(r, 503)
    assert int(r.headers["Retry-After"]) >= 1
    r = httpx.post(srv.url("/v1/chat/completions"), headers=srv.headers,
                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert_error(r, 503)
    with pytest.raises(openai.InternalServerError):
        srv.client().completions.create(model=srv.client().models.list().data[0].id, prompt="hi", max_tokens=2)
    m1 = srv.metrics()
    assert (metric(m1, "pagedserve:admission_rejections_total") - metric(m0, "pagedserve:admission_rejections_total")
            == 3)
    # and it keeps answering
    assert httpx.post(srv.url("/tokenize"), json={"prompt": "hi"}, headers=srv.headers).status_code == 200


def test_unsupported_vllm_flag_exits_with_one_line(tmp_path):
    for module in (["-m", "pagedserve", "serve"], ["-m", "pagedserve.entrypoints.openai.api_server"]):
        p = subprocess.run([sys.executable, *module, "--model", str(tmp_path), "--kv-cache-dtype", "fp8"],
                           capture_output=True, text=True, cwd=str(REPO), timeout=60)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip() == "pagedserve does not support --kv-cache-dtype fp8 yet (only auto)", p.stderr
    p = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--model", str(tmp_path), "--enable-lora"],
                       capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "pagedserve does not support --enable-lora yet"
    # the default values vLLM users often pass explicitly are accepted (argument parsing only)
    from pagedserve.server.cli import register
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--kv-cache-dtype", "auto", "-pp", "1",
                              "--no-enable-prefix-caching", "--served-model-name", "a", "b"])
    from pagedserve.engine.args import config_from_args

    cfg = config_from_args(args)
    assert cfg.enable_prefix_caching is False and cfg.served_model_name == "a" and cfg.model == "m"


# ------------------------------------------------------------------------------------------------
# In-process checks with a pure-Python stand-in for LLMEngine (no model, no subprocess): SSE
# keep-alive pings, engine death -> 503, graceful shutdown, PAGEDSERVE_API_KEY, --chat-template.
class FakeEngine:
    """Emits the token "a" once per step (after `first_delay` s), one step every `step_s` s."""

    def __init__(self, tokenizer, first_delay: float = 0.0, step_s: float = 0.005):
        from types import SimpleNamespace

        from pagedserve import EngineConfig

        self.tokenizer = tokenizer
        self.config = EngineConfig(model="fake-model", max_model_len=64, served_model_name="fake")
        self.spec = SimpleNamespace(vocab_size=len(tokenizer))
        from pagedserve.validation import RequestValidator

        self.validator = RequestValidator(max_model_len=64, vocab_size=len(tokenizer))
        self.first_delay, self.step_s = first_delay, step_s
        self.tok = tokenizer.encode("a", add_special_tokens=False)[0]
        self.reqs: dict = {}

    def add_request(self, request_id, prompt=None, params=None, prompt_token_ids=None, arrival_time=None):
        self.validator.validate(prompt_token_ids, params)
        self.reqs[request_id] = dict(ids=prompt_token_ids, params=params, out=[], t0=time.time())

    def abort_request(self, request_id):
        self.reqs.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        from pagedserve.engine.outputs import CompletionOutput, RequestOutput

        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.reqs.items()):
            if r["ids"] == [66]:
                raise RuntimeError("simulated device failure")
            if time.time() - r["t0"] < self.first_delay:
                continue
            r["out"].append(self.tok)
            done = len(r["out"]) >= r["params"].max_tokens
            o = CompletionOutput(0, "a" * len(r["out"]), list(r["out"]), None, None,
                                 "length" if done else None)
            outs.append(RequestOutput(rid, None, r["ids"], None, [o], done))
            if done:
                del self.reqs[rid]
        return outs

    def stats(self):
        from pagedserve.engine.stats import EngineStats

        return EngineStats(len(self.reqs), 0, 0.5 if self.reqs else 0.0, 1, 2, 0, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def tiny_tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


def _fake_app(tokenizer, monkeypatch, **fake_kw):
    import argparse

    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.server.app import build_app

    ae = AsyncEngine(FakeEngine(tokenizer, **fake_kw), log_requests=False, log_stats=False)
    args = argparse.Namespace(chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
                              shutdown_timeout=1.0, api_key=None)
    app = build_app(ae, args)
    ae.start()  # httpx's ASGITransport does not run the lifespan
    return ae, app


def test_fake_engine_pings_death_shutdown_and_env_key(tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_SSE_PING_SECONDS", "0.05")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "env-key")
    ae, app = _fake_app(tiny_tokenizer, monkeypatch, first_delay=0.4)
    auth = {"Authorization": "Bearer env-key"}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as h:
            # PAGEDSERVE_API_KEY protects /v1 (health stays open)
            assert (await h.get("/v1/models")).status_code == 401
            assert (await h.get("/health")).status_code == 200
            # --chat-template (a template string) is what /tokenize and chat use
            r = await h.post("/tokenize", headers=auth, json={"messages": [{"role": "user", "content": "hi"}]})
            assert tiny_tokenizer.decode(r.json()["tokens"]) == "[hi]"
            # keep-alive pings while waiting for the first token, then normal events
            r = await h.post("/v1/completions", headers=auth,
                             json={"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True})
            body = r.text
            assert body.index(": ping") < body.index("data: {")
            assert body.rstrip().endswith("data: [DONE]")
            # the official client ignores the ping comments
            client = openai.AsyncOpenAI(base_url="http://fake/v1", api_key="env-key", http_client=h, max_retries=0)
            chunks = [c async for c in await client.completions.create(model="fake", prompt="hi", max_tokens=3,
                                                                        stream=True)]
            assert "".join(c.choices[0].text for c in chunks) == "aaa"
            # graceful shutdown: an unfinished request is aborted when the timeout passes
            stream = await ae.add_request("slow", None, __import__("pagedserve").SamplingParams(max_tokens=60),
                                          prompt_token_ids=[5])
            first = await stream.next()
            assert first.outputs[0].finish_reason is None
            await ae.shutdown(timeout=0.2)
            outs = [o async for o in stream]
            assert outs[-1].outputs[0].finish_reason == "abort"
            assert not ae.engine.reqs and not ae.is_alive()
            r = await h.post("/v1/completions", headers=auth, json={"model": "fake", "prompt": "hi"})
            assert_error(r, 503)

    asyncio.run(main())

    # an engine failure: the request gets 503 and /health turns 503
    ae, app = _fake_app(tiny_tokenizer, monkeypatch)

    async def dead():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fake",
                                     headers={"Authorization": "Bearer env-key"}) as h:
            r = await h.post("/v1/completions", json={"model": "fake", "prompt": [66], "max_tokens": 2})
            assert_error(r, 503)
            assert (await h.get("/health")).status_code == 503

    asyncio.run(dead())


def test_sigterm_during_stream_finishes_and_exits_0(server):
    """Runs last: ends the module's main server."""
    body = {"model": server_model(server), "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url("/v1/completions"), json=body) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            for line in it:
                lines.append(line)
                if line.startswith("data: "):
                    break
            server.terminate()
            for line in it:
                lines.append(line)
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    reasons = [e["choices"][0]["finish_reason"] for e in events[:-1]
               if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert reasons == ["length"] and text
    assert server.proc.wait(timeout=30) == 0, server.log()
    # new connections are refused now
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url("/health"), timeout=2)
