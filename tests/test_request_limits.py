"""Every numeric request field at the limits of its type, through the Python API and over HTTP:
values the sampler's tensors cannot hold are a clear error naming the field (never a failed engine
step), extreme values that do mean something are served, and the engine keeps serving."""
from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError

I64_MAX = 2**63 - 1
F32_OVER = 1e39  # finite for Python, inf as a float32

# (field, value): refused with param == field
REFUSED = [
    ("top_k", 2**63), ("top_k", -(2**63) - 1), ("top_k", -2), ("top_k", 1.5),
    ("n", 2**63), ("n", 0), ("n", 129),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 2**70),
    ("max_tokens", 2**63), ("max_tokens", 2**64), ("max_tokens", 0),
    ("min_tokens", 2**63), ("min_tokens", -1),
    ("logprobs", 2**63), ("logprobs", -1), ("logprobs", 21),
    ("prompt_logprobs", 2**63), ("prompt_logprobs", 21),
    ("temperature", F32_OVER), ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -1e-9),
    ("top_p", F32_OVER), ("top_p", float("nan")), ("top_p", 0.0),
    ("min_p", F32_OVER), ("min_p", -1e-30),
    ("presence_penalty", F32_OVER), ("presence_penalty", -2.5),
    ("frequency_penalty", -F32_OVER), ("frequency_penalty", float("-inf")),
    ("repetition_penalty", F32_OVER), ("repetition_penalty", 0.0),
    ("stop_token_ids", [2**63]), ("stop_token_ids", [-1]), ("stop_token_ids", [5] * 1025),
    ("stop", ["x"] * 65), ("stop", ["y" * 1025]), ("stop", [""]),
]

# extremes that mean something: served
ACCEPTED = [
    ("top_k", I64_MAX), ("top_k", -1), ("seed", I64_MAX), ("seed", -(2**63)), ("temperature", 3.0e38),
    ("temperature", 1e-300), ("n", 4), ("logprobs", 20), ("presence_penalty", -2.0), ("repetition_penalty", 2.0),
]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_gpu_blocks_override=64, max_model_len=128, num_threads=1)


def _idle(eng) -> bool:
    bm = eng.block_manager
    return not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}={str(v)[:12]}" for f, v in REFUSED])
def test_python_api_refuses_what_the_sampler_cannot_hold(llm, field, value):
    kw = {"temperature": 1.0, field: value}
    with pytest.raises(InvalidRequestError) as e:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(**kw, **({"max_tokens": 4}
                                                                            if field != "max_tokens" else {})))
    assert e.value.param == field, (e.value.param, str(e.value))
    assert _idle(llm.llm_engine)


@pytest.mark.parametrize("field, value", ACCEPTED, ids=[f"{f}={str(v)[:12]}" for f, v in ACCEPTED])
def test_python_api_serves_meaningful_extremes(llm, field, value):
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True,
                                                                       **{"temperature": 1.0, field: value}))[0]
    assert all(len(o.token_ids) == 3 for o in out.outputs)
    assert _idle(llm.llm_engine)


def test_prompt_text_that_cannot_fit_is_refused_before_tokenizing(llm, monkeypatch):
    eng = llm.llm_engine
    limit = eng.validator.max_prompt_chars
    assert 0 < limit < 3_000_000
    calls = []
    monkeypatch.setattr(eng.tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    with pytest.raises(InvalidRequestError, match="characters") as e:
        llm.generate("a" * 3_000_000, SamplingParams(max_tokens=2))
    assert e.value.param == "prompt" and not calls


# ------------------------------------------------------------------------------------------------
# over HTTP: the real app in process (no uvicorn), the same engine
@pytest.fixture(scope="module")
def app(llm):
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.server.app import build_app

    ae = AsyncEngine(llm.llm_engine, log_requests=False, log_stats=False)
    app = build_app(ae, argparse.Namespace(api_key=None, shutdown_timeout=1.0))
    ae.start()
    yield app
    asyncio.run(ae.shutdown(timeout=1.0))


def _http(app, calls):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as h:
            return [await h.post(path, json=body) for path, body in calls]

    return asyncio.run(main())


def _assert_openai_error(r, status, param):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"], err


CHAT = [{"role": "user", "content": "hi"}]


def test_http_refuses_each_field_at_its_limits_and_keeps_serving(app, llm):
    calls = []
    for field, value in REFUSED:
        if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
            continue  # JSON has no NaN / Infinity (the protocol tests cover the strings "nan" and "inf")
        extra = {"max_tokens": 4} if field != "max_tokens" else {}
        calls.append(("/v1/completions", {"prompt": [1, 2, 3], "temperature": 1.0, field: value, **extra}))
        chat_value = value if field != "prompt_logprobs" else 2**63  # chat has no prompt_logprobs: use top_k
        calls.append(("/v1/chat/completions", {"messages": CHAT, "temperature": 1.0, **extra,
                                               **({field: value} if field != "prompt_logprobs" else {"top_k": chat_value})}))
    calls.append(("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2**63, "logprobs": True}))
    calls.append(("/v1/completions", {"prompt": [[1, 2]] * 1025, "max_tokens": 1}))
    calls.append(("/v1/completions", {"prompt": "a" * 3_000_000, "max_tokens": 1}))
    calls.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 3_000_000}]}))
    ok = ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "top_k": I64_MAX, "seed": -(2**63)})
    rs = _http(app, calls + [ok])
    chat_field = {"prompt_logprobs": "top_k"}
    i = 0
    for field, value in REFUSED:
        if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
            continue
        _assert_openai_error(rs[i], 400, field)
        if field == "logprobs":
            assert rs[i + 1].status_code == 400  # a bool field given a number
        else:
            _assert_openai_error(rs[i + 1], 400, chat_field.get(field, field))
        i += 2
    _assert_openai_error(rs[i], 400, "top_logprobs")
    _assert_openai_error(rs[i + 1], 400, "prompt")
    _assert_openai_error(rs[i + 2], 400, "prompt")
    _assert_openai_error(rs[i + 3], 400, "messages")
    assert rs[-1].status_code == 200, rs[-1].text
    assert rs[-1].json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert _idle(llm.llm_engine)
