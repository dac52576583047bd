"""Structured outputs (JSON schema, regex, choice, grammar) through the Python API and the OpenAI
client, on the tiny random Llama: whatever the random weights prefer, every output must follow
its constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from api_app import InProcessServer
from hf_reference import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.structured import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/color"}, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "score", "tags", "home"],
    "additionalProperties": False,
    "$defs": {
        "color": {"enum": ["red", "green", "blue"]},
        "place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["city", "zip"], "additionalProperties": False},
    },
}
LIST = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4}
ENUM = {"enum": ["yes", "no", 3, None]}
SCHEMAS = [PERSON, LIST, ENUM]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)"
SEEDS = range(4)


def _sampled(so, seed, max_tokens=120, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_gpu_blocks_override=512, seed=0)


def _pool_full(llm):
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def test_json_schemas_validate_over_seeded_samples(llm):
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    outs = llm.generate(["Once upon a time"] * len(cases),
                        [_sampled(StructuredOutputsParams(json=s), seed) for s, seed in cases])
    for (schema, _), o in zip(cases, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    # json_object: any JSON object (random weights rarely close one: unbounded strings); n > 1 gives
    # each sequence its own matcher
    out = llm.generate("Hello", _sampled(StructuredOutputsParams(json_object=True), 1, n=3, max_tokens=30))[0]
    assert len({c.text for c in out.outputs}) == 3
    for c in out.outputs:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    assert _pool_full(llm)


def test_regex_choice_and_grammar_outputs_match(llm):
    params = ([_sampled({"regex": REGEX}, s) for s in SEEDS] + [_sampled({"choice": ["positive", "negative", "n/a"]}, s)
                                                               for s in SEEDS]
              + [_sampled({"grammar": GRAMMAR}, s, max_tokens=60) for s in SEEDS]
              + [SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": REGEX})])
    outs = llm.generate(["Once"] * len(params), params)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(REGEX, t) for t in texts[0:4] + texts[-1:])
    assert all(t in ("positive", "negative", "n/a") for t in texts[4:8])
    assert all(re.fullmatch(GRAMMAR_RE, t) for t in texts[8:12]), texts[8:12]
    # a Lark grammar too (llguidance's native form)
    lark = llm.generate("x", _sampled({"grammar": 'start: "a" B\nB: /[bc]{2}/'}, 0))[0].outputs[0].text
    assert re.fullmatch("a[bc]{2}", lark)


def test_unconstrained_rows_unchanged_by_constrained_batchmates(llm):
    vocab = llm.llm_engine.spec.vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, vocab, [5, 30, 12, 50], seed=3)]
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)] * 2
    alone = llm.generate(prompts, plain)
    constrained = [_sampled(StructuredOutputsParams(json=PERSON), 5), _sampled({"regex": REGEX}, 6),
                   SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["a", "bb"]})]
    mixed = llm.generate(prompts + ["Once upon a time"] * 3, plain + constrained)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[4].outputs[0].text), PERSON)
    assert re.fullmatch(REGEX, mixed[5].outputs[0].text) and mixed[6].outputs[0].text in ("a", "bb")


def test_constraint_cut_by_max_tokens_ends_with_length(llm):
    out = llm.generate("Once", _sampled(StructuredOutputsParams(json=PERSON), 0, max_tokens=4))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("so, message", [
    ({"regex": "a("}, "unclosed group"),
    ({"json": {"type": "foo"}}, "Invalid type: foo"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"grammar": 'root ::= "a" undefined_rule'}, "undefined_rule"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"jsn": {}}, "unsupported key"),
])
def test_invalid_constraints_are_rejected_before_any_compute(llm, so, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=so))
    assert e.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests() and _pool_full(llm)


def test_grammars_are_compiled_once_per_constraint(llm):
    compiler = llm.llm_engine.structured
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"], "title": "cache"}
    llm.generate("x", _sampled({"json": schema}, 0, max_tokens=3))
    misses = compiler.misses
    # the same schema with its keys in another order is the same grammar
    llm.generate(["x", "y"], _sampled({"json": dict(reversed(list(schema.items())))}, 1, max_tokens=3))
    assert compiler.misses == misses


def test_constrained_requests_decode_without_drafts_under_speculation(llama_dir):
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    prompt = "[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"
    outs = llm.generate([prompt] * 4, [_sampled({"json": LIST}, s) for s in range(3)]
                        + [SamplingParams(temperature=0, max_tokens=16)])
    for o in outs[:3]:
        jsonschema.validate(json.loads(o.outputs[0].text), LIST)
    assert _pool_full(llm)


# ------------------------------------------------------------------------------------------------
# over HTTP with the real openai client
@pytest.fixture(scope="module")
def srv(llama_dir):
    return InProcessServer(llama_dir, max_model_len=1024)  # room for the tools the chat template renders


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    zip: str = pydantic.Field(pattern="^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    home: Place


HI = [{"role": "user", "content": "Describe a person as JSON."}]


def test_openai_response_format_streaming_and_not(srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def go(h, c):
        for seed in SEEDS:
            r = await c.chat.completions.create(model=srv.model, messages=HI, response_format=fmt, seed=seed,
                                                max_tokens=150)
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            stream = await c.chat.completions.create(model=srv.model, messages=HI, response_format=fmt, seed=seed,
                                                     max_tokens=150, stream=True)
            parts, finish = [], None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            assert finish == "stop"
            jsonschema.validate(json.loads("".join(parts)), PERSON)
            # completions take response_format too
            r = await c.completions.create(model=srv.model, prompt="Once", seed=seed, max_tokens=80, extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": LIST}}})
            jsonschema.validate(json.loads(r.choices[0].text), LIST)
            r = await c.chat.completions.create(model=srv.model, messages=HI, seed=seed, max_tokens=10,
                                                response_format={"type": "json_object"})
            assert r.choices[0].message.content.startswith("{")  # random weights rarely close an open object
        # the client's parse() helper: the schema from a pydantic model, the answer parsed back into it
        for seed in SEEDS:
            parsed = await c.chat.completions.parse(model=srv.model, messages=HI, response_format=Person,
                                                    seed=seed, max_tokens=150)
            person = parsed.choices[0].message.parsed
            assert isinstance(person, Person) and 0 <= person.age <= 120
        assert srv.free_blocks_ok()

    srv.run(go)


def test_vllm_fields_and_responses_text_format(srv):
    async def go(h, c):
        async def chat(**extra):
            r = await c.chat.completions.create(model=srv.model, messages=HI, seed=1, max_tokens=60,
                                                extra_body=extra)
            return r.choices[0].message.content

        assert re.fullmatch(REGEX, await chat(guided_regex=REGEX))
        assert await chat(guided_choice=["cat", "dog"]) in ("cat", "dog")
        assert re.fullmatch(GRAMMAR_RE, await chat(guided_grammar=GRAMMAR))
        jsonschema.validate(json.loads(await chat(guided_json=LIST, guided_decoding_backend="guidance")), LIST)
        assert re.fullmatch(REGEX, await chat(structured_outputs={"regex": REGEX}))
        spaced = await chat(structured_outputs={"json": LIST}, guided_whitespace_pattern="[ ]")
        jsonschema.validate(json.loads(spaced), LIST)
        r = await c.completions.create(model=srv.model, prompt="Once", max_tokens=40, seed=2,
                                       extra_body={"guided_choice": ["up", "down"]})
        assert r.choices[0].text in ("up", "down")
        resp = await c.responses.create(model=srv.model, input="Describe a person.", max_output_tokens=150,
                                        text={"format": {"type": "json_schema", "name": "p", "schema": PERSON}})
        jsonschema.validate(json.loads(resp.output_text), PERSON)

    srv.run(go)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "Invalid type: nope"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a `json_schema` object"),
    ({"guided_regex": "(["}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one constraint only"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "needs a JSON constraint"),
])
def test_invalid_constraint_is_a_400_naming_the_field(srv, body, param, message):
    async def go(h, c):
        r = await h.post("/v1/chat/completions", json={"model": srv.model, "messages": HI, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
        assert srv.free_blocks_ok()

    srv.run(go)


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
             "required": ["zone"], "additionalProperties": False}}}]


def _check_call(call, name=None):
    assert call["id"].startswith("call_") and call["type"] == "function"
    fn = call["function"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert fn["name"] in schemas and (name is None or fn["name"] == name)
    jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])


def test_forced_tool_calls_always_parse_streaming_and_not(srv):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(h, c):
        for seed in range(3):
            # (an unbounded "required" array is valid too, but random weights seldom close it)
            for choice, parallel in ((named, None), ("required", False)):
                kw = dict(model=srv.model, messages=HI, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=100)
                if parallel is not None:
                    kw["parallel_tool_calls"] = parallel
                r = await c.chat.completions.create(**kw)
                ch = r.choices[0]
                assert ch.finish_reason == "tool_calls" and ch.message.content is None
                calls = [tc.model_dump() for tc in ch.message.tool_calls]
                assert calls and (parallel is not False or len(calls) == 1)
                for call in calls:
                    _check_call(call, "get_weather" if choice is named else None)
                stream = await c.chat.completions.create(stream=True, **kw)
                deltas, finish = [], None
                async for chunk in stream:
                    if chunk.choices:
                        d = chunk.choices[0].delta
                        assert not d.content
                        deltas.extend(tc.model_dump() for tc in d.tool_calls or [])
                        finish = chunk.choices[0].finish_reason or finish
                assert finish == "tool_calls" and [d["index"] for d in deltas] == list(range(len(deltas)))
                assert [d["function"] for d in deltas] == [c["function"] for c in calls]  # same seed, same call
        # a forced call cut by max_tokens is text with finish_reason length, never a broken call
        r = await c.chat.completions.create(model=srv.model, messages=HI, tools=TOOLS, tool_choice=named,
                                            max_tokens=3)
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
        bad = await h.post("/v1/chat/completions", json={
            "model": srv.model, "messages": HI, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        assert srv.free_blocks_ok()

    srv.run(go)
