"""OpenAI / vLLM API parity through the real `openai` client and raw HTTP, on an in-process server
over the tiny random Llama: vLLM's stop / min_tokens rules, prompt_logprobs, tools in the chat
template, the logits controls (logit_bias, allowed_token_ids, bad_words), prompt truncation and
scoring, echo, token-id returns and the response shapes OpenAI clients read."""
from __future__ import annotations

import asyncio
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
        # ('required' and a named function are forced by the grammar: tests/test_structured_outputs.py)
        for extra in ({}, {"tool_choice": "auto"},
                      {"tool_choice": {"type": "function", "function": {"name": "not_a_tool"}}}):
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
        # best_of: only equal to n; response_format: an unknown type is a 400
        assert (await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 1,
                                                      "best_of": 1})).status_code == 200
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "best_of": 2}), "best_of")
        _err(await h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT,
                                                   "response_format": {"type": "xml"}}), "response_format")
        with pytest.raises(openai.BadRequestError, match="response_format type 'xml' is not supported"):
            await c.chat.completions.create(model=srv.model, messages=HI, response_format={"type": "xml"})

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


# ------------------------------------------------------------------------------------------------
# routes
def test_responses_api_text_streaming_and_previous_response_id(srv):
    async def go(h, c):
        first = await c.responses.create(model=srv.model, input="Once upon a time", max_output_tokens=4,
                                         temperature=0, instructions="Be brief.", metadata={"k": "v"})
        assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
        assert first.usage.output_tokens == 4 and first.output_text and first.metadata == {"k": "v"}
        assert first.output[0].content[0].type == "output_text"
        # the same turn as chat: instructions become a system message
        chat = await c.chat.completions.create(model=srv.model, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}])
        assert first.output_text == chat.choices[0].message.content
        assert first.usage.input_tokens == chat.usage.prompt_tokens
        # streaming: OpenAI's typed events, the deltas adding up to the final text
        events = [e async for e in await c.responses.create(model=srv.model, input="Once upon a time",
                                                             max_output_tokens=4, temperature=0, stream=True,
                                                             instructions="Be brief.")]
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # previous_response_id continues the stored conversation (instructions are not carried over)
        second = await c.responses.create(model=srv.model, input="And then?", previous_response_id=first.id,
                                          max_output_tokens=3, temperature=0)
        chat2 = await c.chat.completions.create(model=srv.model, max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}])
        assert second.output_text == chat2.choices[0].message.content
        assert second.previous_response_id == first.id
        assert (await c.responses.retrieve(first.id)).output_text == first.output_text
        r = await h.post("/v1/responses", json={"model": srv.model, "input": "x", "previous_response_id": "resp_no"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        unstored = await c.responses.create(model=srv.model, input="x", max_output_tokens=1, store=False)
        assert (await h.get(f"/v1/responses/{unstored.id}")).status_code == 404
        listed = await c.responses.create(model=srv.model, max_output_tokens=4, temperature=0, input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}])
        assert listed.output_text == first.output_text  # the developer message is the system prompt
        for bad in ({"tools": [{"type": "function", "name": "f"}]}, {"text": {"format": {"type": "xml"}}},
                    {"reasoning": {"effort": "low"}}, {"input": [{"type": "input_image", "image_url": "x"}]}):
            _err(await h.post("/v1/responses", json={"model": srv.model, "input": "x", **bad}))

    srv.run(go)


def test_response_store_is_bounded():
    from pagedserve.server.protocol import APIError
    from pagedserve.server.serving_responses import ResponseStore

    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    assert len(store) == 2 and store.get("r2")[1] == {"id": "r2"}
    with pytest.raises(APIError):
        store.get("r0")  # the oldest went first


def test_load_ping_and_metric_families(srv):
    async def go(h, c):
        assert (await h.get("/load")).json() == {"server_load": 0}
        assert (await h.get("/ping")).status_code == 200 and (await h.post("/ping")).status_code == 200
        # /load counts generation requests in progress
        long = asyncio.ensure_future(h.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT,
                                                                     "max_tokens": 200, "ignore_eos": True}))
        seen = 0
        for _ in range(400):
            seen = max(seen, (await h.get("/load")).json()["server_load"])
            if seen or long.done():
                break
            await asyncio.sleep(0.005)
        assert seen == 1
        assert (await long).status_code == 200 and (await h.get("/load")).json() == {"server_load": 0}
        await c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0,
                                   extra_body={"ignore_eos": True})
        # a prompt two blocks long, twice: the second finds its first block in the prefix cache
        long_prompt = list(range(10, 44))
        for _ in range(2):
            await c.completions.create(model=srv.model, prompt=long_prompt, max_tokens=1)
        text = (await h.get("/metrics")).text
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("cache_config_info", "num_requests_waiting_by_reason", "prompt_tokens_cached",
                     "prompt_tokens_by_source", "prompt_tokens_cached_by_source", "request_num_preemptions",
                     "request_params_max_tokens", "request_params_n", "request_max_num_generation_tokens",
                     "request_prefill_kv_computed_tokens", "request_time_per_output_token_seconds",
                     "estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu",
                     "gpu_cache_usage_perc"):
            assert "pagedserve:" + name in fams, name
        for name in ("process_cpu_seconds", "python_info", "python_gc_objects_collected", "http_requests",
                     "http_request_duration_seconds"):
            assert name in fams, name

        def value(sample, **labels):
            return sum(s.value for f in fams.values() for s in f.samples
                       if s.name == sample and labels.items() <= s.labels.items())

        assert value("pagedserve:request_params_n_sum") >= 2
        assert value("pagedserve:request_max_num_generation_tokens_sum") >= 3
        assert value("pagedserve:estimated_flops_per_gpu_total") > 0
        hits = value("pagedserve:prompt_tokens_by_source_total", source="local_cache_hit")
        assert hits >= 32 and value("pagedserve:prompt_tokens_cached_total") == hits
        assert value("pagedserve:prompt_tokens_by_source_total", source="local_compute") + hits == \
            value("pagedserve:prompt_tokens_total")
        assert value("pagedserve:cache_config_info", block_size="16", num_gpu_blocks="64") == 1
        assert value("http_requests_total", handler="/v1/completions", method="POST", status="2xx") >= 1
        assert value("http_requests_total", handler="none", status="4xx") == 0
        await h.get("/no/such/path")
        text = (await h.get("/metrics")).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert value("http_requests_total", handler="none", status="4xx") == 1

    srv.run(go)


# ------------------------------------------------------------------------------------------------
# no field accepted and ignored
_BASE = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
}


def test_every_request_field_is_read_by_the_serving_code_or_rejected(srv, monkeypatch):
    """Drives every route in each of its modes while recording which request-model fields the
    serving code reads; a field marked supported / partial that nothing reads is accepted and
    ignored, and fails here. Every field marked rejected must be a 400 naming it."""
    from pagedserve.server import protocol as P
    from pagedserve.server.api_doc import ROUTES

    reads: set = set()

    def spy(self, name):
        cls = object.__getattribute__(self, "__class__")
        if name in cls.__pydantic_fields__:
            reads.add((cls.__name__, name))
        return object.__getattribute__(self, name)

    monkeypatch.setattr(P.OpenAIBaseModel, "__getattribute__", spy)
    m = {"model": srv.model}

    async def go(h, c):
        for body in (
            {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "echo": True},
            {"prompt": [PROMPT, [5, 6]], "max_tokens": 2, "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ):
            assert (await h.post("/v1/completions", json={**m, **body})).status_code == 200
        for body in (
            {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 1},
            {"messages": HI, "max_completion_tokens": 2, "stream": True, "tools": TOOLS, "tool_choice": "none",
             "stream_options": {"include_usage": True}},
        ):
            assert (await h.post("/v1/chat/completions", json={**m, **body})).status_code == 200
        for body in ({"input": "hi", "max_output_tokens": 2}, {"input": "hi", "max_output_tokens": 2, "stream": True}):
            assert (await h.post("/v1/responses", json={**m, **body})).status_code == 200
        assert (await h.post("/tokenize", json={**m, "prompt": "hi"})).status_code == 200
        assert (await h.post("/tokenize", json={**m, "messages": HI})).status_code == 200
        assert (await h.post("/detokenize", json={**m, "tokens": [5, 6]})).status_code == 200
        # rejected fields: each alone is a 400 that names it
        for route, model in ROUTES:
            path = route.split()[-1]
            for name in model.model_fields:
                info = P.field_support(model, name)
                if path in _BASE and info["support"] == "rejected":
                    r = await h.post(path, json={**m, **_BASE[path], name: info["example"]})
                    assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, name, r.text)

    srv.run(go)
    assert srv.free_blocks_ok()  # every request's KV blocks are back
    unread = [f"{model.__name__}.{name}" for _, model in ROUTES for name in model.model_fields
              if P.field_support(model, name)["support"] != "rejected" and (model.__name__, name) not in reads]
    assert not unread, f"accepted but never read by the serving code: {unread}"
