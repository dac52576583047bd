"""OpenAI / vLLM API parity through the real `openai` client and raw HTTP, on an in-process server
over the tiny random Llama: vLLM's stop / min_tokens rules, prompt_logprobs, tools in the chat
template, the logits controls (logit_bias, allowed_token_ids, bad_words), prompt truncation and
scoring, echo, token-id returns and the response shapes OpenAI clients read."""
from __future__ import annotations

import json

import openai
import pytest
from api_app import InProcessServer

PROMPT = "Once upon a time there was"
EOS = 2  # "</s>" in tests/tiny_models.py's tokenizer


@pytest.fixture(scope="module")
def srv(llama_dir):
    return InProcessServer(llama_dir)


def _err(r, param=None):
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] == "BadRequestError"
    if param is not None:
        assert err["param"] == param, err
    return err


async def _seeded(h, model, n=8, **kw):
    """A seeded sample: reproducible, and more varied than the tiny model's greedy loops."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "return_token_ids": True, **kw}
    r = await h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _decode(srv, ids):
    return srv.engine.tokenizer.decode(ids)


def _clean_position(srv, ids, start=1):
    """An output position whose token decodes to clean ASCII text found nowhere else in the output."""
    text = _decode(srv, ids)
    for k in range(start, len(ids)):
        piece = _decode(srv, [ids[k]])
        if piece.strip() and piece.isascii() and ids.count(ids[k]) == 1 and text.count(piece) == 1:
            return k, piece
    pytest.fail(f"no usable token in the greedy output {ids!r}")


# ------------------------------------------------------------------------------------------------
# bugs
def test_stop_token_text_is_left_out_unless_asked(srv):
    async def go(h, c):
        full = await _seeded(h, srv.model, 10)
        ids = full["token_ids"]
        k, piece = _clean_position(srv, ids)
        stop = ids[k]
        out = await _seeded(h, srv.model, 10, stop_token_ids=[stop])
        assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
        assert out["token_ids"] == ids[:k + 1]  # the stop token is generated...
        assert out["text"] == _decode(srv, ids[:k])  # ...but its text is not in the output
        kept = await _seeded(h, srv.model, 10, stop_token_ids=[stop], include_stop_str_in_output=True)
        assert kept["text"] == _decode(srv, ids[:k + 1])
        # the same after min_tokens (the stop token may only end the request from there on)
        late = await _seeded(h, srv.model, 10, stop_token_ids=[stop], min_tokens=k)
        assert late["text"] == _decode(srv, ids[:k]) and late["finish_reason"] == "stop"
        # chat through the openai client
        chat = await c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=10, seed=7, extra_body={"ignore_eos": True,
                                                                                     "return_token_ids": True})
        cids = chat.choices[0].token_ids
        ck, _ = _clean_position(srv, cids)
        chat2 = await c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=10, seed=7,
                                                extra_body={"ignore_eos": True, "stop_token_ids": [cids[ck]]})
        assert chat2.choices[0].message.content == _decode(srv, cids[:ck])

    srv.run(go)


def test_min_tokens_checks_stop_strings_only_after_min_tokens(srv):
    async def go(h, c):
        ids = (await _seeded(h, srv.model, 12))["token_ids"]
        k, piece = _clean_position(srv, ids, start=1)
        full_text = _decode(srv, ids)
        # stop strings count from the token after the min_tokens-th: with min_tokens=k the (k+1)-th
        # token's text stops the request...
        out = await _seeded(h, srv.model, 12, stop=[piece], min_tokens=k)
        assert out["finish_reason"] == "stop" and out["stop_reason"] == piece
        assert out["text"] == full_text[:full_text.index(piece)]
        # ...with min_tokens=k+1 it is part of the first min_tokens tokens and is never searched
        out = await _seeded(h, srv.model, 12, stop=[piece], min_tokens=k + 1)
        assert out["finish_reason"] == "length" and out["text"] == full_text

    srv.run(go)


def test_prompt_logprobs_are_returned(srv):
    async def go(h, c):
        r = await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 2,
                                                  "prompt_logprobs": 2, "return_token_ids": True})
        ch = r.json()["choices"][0]
        plp, pids = ch["prompt_logprobs"], ch["prompt_token_ids"]
        assert len(plp) == len(pids) and plp[0] is None
        for tid, d in zip(pids[1:], plp[1:]):
            assert str(tid) in d and 2 <= len(d) <= 3
            assert {"logprob", "rank", "decoded_token"} <= set(d[str(tid)])
        # chat: top level, as vLLM
        chat = await c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body={"prompt_logprobs": 0})
        extra = chat.model_extra
        assert extra["prompt_logprobs"][0] is None and len(extra["prompt_logprobs"]) == chat.usage.prompt_tokens
        # streaming carries them on the first chunk with tokens
        r = await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 3,
                                                  "prompt_logprobs": 1, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
        first = events[0]["choices"][0]["prompt_logprobs"]
        assert len(first) == len(pids) and first[0] is None
        assert all(str(t) in d for t, d in zip(pids[1:], first[1:]))
        assert all(e["choices"][0].get("prompt_logprobs") is None for e in events[1:])

    srv.run(go)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HI = [{"role": "user", "content": "hi"}]


def test_tools_reach_the_template_with_tool_choice_none_and_auto_is_one_clear_400(srv):
    async def go(h, c):
        plain = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=1)
        tok = (await h.post("/tokenize", json={"messages": HI, "tools": TOOLS})).json()
        assert "get_weather" in srv.engine.tokenizer.decode(tok["tokens"])
        none = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=1, tools=TOOLS,
                                               tool_choice="none")
        assert none.usage.prompt_tokens == tok["count"] > plain.usage.prompt_tokens
        # 'auto' means the same whether sent or implied by tools: both need tool-call parsing
        for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"},
                      {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
            r = await h.post("/v1/chat/completions", json={"model": srv.model, "messages": HI, "tools": TOOLS,
                                                           **extra})
            assert "tool_choice" in _err(r, "tool_choice")["message"]
        _err(await h.post("/v1/chat/completions", json={"model": srv.model, "messages": HI,
                                                         "parallel_tool_calls": False}), "parallel_tool_calls")

    srv.run(go)


def test_continue_final_message_with_add_generation_prompt_is_400_and_chat_echo(srv):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]

    async def go(h, c):
        r = await h.post("/v1/chat/completions", json={"model": srv.model, "messages": msgs,
                                                       "continue_final_message": True})
        _err(r, "continue_final_message")
        body = {"model": srv.model, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
                "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        cont = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
        echoed = (await h.post("/v1/chat/completions", json={**body, "echo": True})).json()
        assert echoed["choices"][0]["message"]["content"] == "Once upon" + cont
        stream = await c.chat.completions.create(model=srv.model, messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"echo": True, "ignore_eos": True,
                                                                          "continue_final_message": True,
                                                                          "add_generation_prompt": False})
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == "Once upon" + cont
        # echo when the last message is not the reply's role: nothing to echo
        r = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=2, temperature=0,
                                            extra_body={"echo": True})
        assert not r.choices[0].message.content.startswith("hi")

    srv.run(go)


def test_logit_bias_allowed_token_ids_and_bad_words(srv):
    async def go(h, c):
        # a bias of 100 makes a token win every step (completions and chat)
        out = await _seeded(h, srv.model, 5, logit_bias={"300": 100})
        assert out["token_ids"] == [300] * 5
        chat = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=3, logit_bias={"301": 100},
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert chat.choices[0].token_ids == [301] * 3
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "logit_bias": {"x": 1}}),
             "logit_bias")
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT,
                                                   "logit_bias": {"999999": 1}}), "logit_bias")
        # sampling only among the allowed ids
        out = await _seeded(h, srv.model, 12, allowed_token_ids=[100, 200, 300])
        assert set(out["token_ids"]) <= {100, 200, 300} and len(set(out["token_ids"])) > 1
        # a bad word never appears: the seeded run's first token, then a two-token word
        ids = (await _seeded(h, srv.model, 12))["token_ids"]
        word = _decode(srv, [ids[0]])
        variants = [srv.engine.tokenizer.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]
        banned = {v[0] for v in variants if len(v) == 1}
        assert ids[0] in banned
        out = await _seeded(h, srv.model, 12, bad_words=[word])
        assert not banned & set(out["token_ids"])
        enc = srv.engine.tokenizer.encode
        for i in range(1, len(ids) - 1):
            pair = _decode(srv, ids[i:i + 2])
            if ids[i:i + 2] in (enc(pair.lstrip(), add_special_tokens=False),
                                enc(" " + pair.lstrip(), add_special_tokens=False)):
                break
        else:
            pytest.fail(f"no two-token word re-encodes as itself in {ids!r}")
        got = (await _seeded(h, srv.model, 12, bad_words=[pair]))["token_ids"]
        assert got[:i + 1] == ids[:i + 1] and got[i + 1] != ids[i + 1]  # only the word's last token is banned
        assert all(got[j:j + 2] != ids[i:i + 2] for j in range(len(got) - 1))

    srv.run(go)


def test_truncate_prompt_tokens_and_prompt_scoring(srv):
    async def go(h, c):
        ids = srv.engine.tokenizer.encode(PROMPT)
        r = await c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
        assert r.usage.prompt_tokens == 3
        tail = await c.completions.create(model=srv.model, prompt=ids[-3:], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.choices[0].text == tail.choices[0].text
        chat = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=1,
                                               extra_body={"truncate_prompt_tokens": 2})
        assert chat.usage.prompt_tokens == 2
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT,
                                                   "truncate_prompt_tokens": 0}), "truncate_prompt_tokens")
        # echo + max_tokens 0 + logprobs: the prompt's logprobs, nothing generated (vLLM's prompt scoring)
        for stream in (False, True):
            r = await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 0,
                                                      "echo": True, "logprobs": 1, "stream": stream,
                                                      "stream_options": {"include_usage": True} if stream else None})
            assert r.status_code == 200, r.text
            if stream:
                evs = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
                ch, usage = evs[0]["choices"][0], evs[-1]["usage"]
            else:
                ch, usage = r.json()["choices"][0], r.json()["usage"]
            assert ch["text"] == PROMPT and usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
            assert len(ch["logprobs"]["tokens"]) == len(ids) and ch["logprobs"]["token_logprobs"][0] is None
            assert all(v is not None for v in ch["logprobs"]["token_logprobs"][1:])
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 0}),
             "max_tokens")

    srv.run(go)


def test_token_ids_special_tokens_and_response_shapes(srv):
    async def go(h, c):
        # skip_special_tokens=false shows the EOS text (forced here with a bias)
        body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True,
                "logit_bias": {str(EOS): 100}}
        assert (await h.post("/v1/completions", json=body)).json()["choices"][0]["text"] == ""
        shown = (await h.post("/v1/completions", json={**body, "skip_special_tokens": False})).json()
        assert shown["choices"][0]["text"] == "</s></s>"
        _err(await h.post("/v1/completions", json={**body, "spaces_between_special_tokens": False}),
             "spaces_between_special_tokens")
        # return_tokens_as_token_ids: logprob tokens as "token_id:N"
        r = (await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 3,
                                                   "logprobs": 1, "return_tokens_as_token_ids": True,
                                                   "return_token_ids": True})).json()["choices"][0]
        assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
        assert r["prompt_token_ids"] == srv.engine.tokenizer.encode(PROMPT)
        chat = await c.chat.completions.create(model=srv.model, messages=HI, max_tokens=2, logprobs=True,
                                               extra_body={"return_tokens_as_token_ids": True,
                                                           "return_token_ids": True})
        assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in
                                                                       chat.choices[0].token_ids]
        assert chat.model_extra["prompt_token_ids"] and chat.service_tier == "default"
        assert chat.system_fingerprint.startswith("fp_")
        # completion top_logprobs: the sampled token first, then the best ones (vLLM's order)
        r = (await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 12,
                                                   "logprobs": 2, "temperature": 2.0, "seed": 3})).json()
        lp = r["choices"][0]["logprobs"]
        assert r["system_fingerprint"].startswith("fp_")
        unlikely = 0
        for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
            keys = list(top)
            assert keys[0] == tok and 2 <= len(keys) <= 3
            rest = [top[k] for k in keys[1:]]
            assert rest == sorted(rest, reverse=True)
            unlikely += len(keys) == 3
        assert unlikely  # some sampled token was outside the top 2 and still came first
        # streaming: `usage` is absent (not null) on chunks that carry none
        for path, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": HI})):
            r = await h.post(path, json={"model": srv.model, "max_tokens": 2, "stream": True, **extra})
            evs = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
            assert evs and all("usage" not in e and e["system_fingerprint"].startswith("fp_") for e in evs)
        # best_of: only equal to n; response_format on completions: text only
        assert (await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 1,
                                                      "best_of": 1})).status_code == 200
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "best_of": 2}), "best_of")
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT,
                                                   "response_format": {"type": "json_object"}}), "response_format")
        with pytest.raises(openai.BadRequestError, match="constrained decoding"):
            await c.chat.completions.create(model=srv.model, messages=HI, response_format={"type": "json_object"})

    srv.run(go)


def test_mixed_prompt_lists_and_request_id(srv):
    async def go(h, c):
        ids = srv.engine.tokenizer.encode(PROMPT)
        r = await h.post("/v1/completions", json={"model": srv.model, "prompt": [PROMPT, ids, "hello"],
                                                  "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                  "request_id": "abc"})
        body = r.json()
        assert body["id"] == "cmpl-abc" and [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        assert body["choices"][0]["text"] == body["choices"][1]["text"]
        for bad in ([PROMPT, 5], [[]], [], [[1, "a"]]):
            _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": bad}), "prompt")

    srv.run(go)
