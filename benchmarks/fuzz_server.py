"""Fuzz the OpenAI-compatible server over every route it documents.

Cases come from two sources: schemathesis + hypothesis draw requests from the server's own
OpenAPI document (valid ones and deliberately invalid ones, for each route), and a hand-written
list of hostile requests (broken JSON, numbers past int64, deep nesting, huge prompts, NUL bytes,
paths as model names, ...). What must hold:

* no response is a 5xx, and no stream carries an in-band 5xx error;
* every 4xx has an OpenAI-style body: {"error": {"message", "type", "param", "code"}} (TGI's
  routes: TGI's {"error", "error_type"});
* afterwards the server still serves, nothing runs or waits, and the KV pool is full again.

    python benchmarks/fuzz_server.py --model DIR --requests 3000 [--seed 0] [--output-json PATH]
    python benchmarks/fuzz_server.py --url http://127.0.0.1:8000 --requests 3000

With --model it starts `pagedserve serve` itself (small --max-model-len, so that valid requests
asking for the maximum stay quick). tests/test_fuzz.py runs the same code on a few hundred cases.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

NOT_SET = object()


@dataclass
class Call:
    method: str
    path: str
    json: Any = NOT_SET
    content: bytes | None = None
    params: dict | None = None
    headers: dict = field(default_factory=dict)
    source: str = "hostile"

    def send(self, client):
        kw: dict = {"params": self.params or None, "headers": self.headers or None}
        if self.content is not None:
            kw["content"] = self.content
        elif self.json is not NOT_SET:
            kw["content"] = json.dumps(self.json, allow_nan=True).encode()
            kw["headers"] = {"content-type": "application/json", **(self.headers or {})}
        return client.request(self.method, self.path, **kw)


def hostile_calls(model: str) -> list[Call]:
    """Requests a careless or malicious client sends; each must get a clean 2xx or 4xx."""
    C, CH = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    calls = [
        Call("POST", C, content=b"{not json", headers={"content-type": "application/json"}),
        Call("POST", C, content=b"", headers={"content-type": "application/json"}),
        Call("POST", C, content=b"\xff\xfe\x00garbage", headers={"content-type": "application/json"}),
        Call("POST", C, content=json.dumps({"prompt": "hi"}).encode(), headers={"content-type": "text/plain"}),
        Call("POST", C, content=b'{"prompt": ' + deep + b"}", headers={"content-type": "application/json"}),
        Call("POST", C, content=b'{"prompt": "hi", "max_tokens": NaN}', headers={"content-type": "application/json"}),
        Call("POST", C, content=b'{"prompt": "hi", "temperature": Infinity}',
             headers={"content-type": "application/json"}),
        Call("POST", C, content=b'{"prompt": "hi", "top_k": 1e400}', headers={"content-type": "application/json"}),
        Call("POST", C, json=[1, 2, 3]),
        Call("POST", C, json="just a string"),
        Call("POST", C, json=None),
        Call("POST", C, json={"prompt": "\x00\x00\x00", "max_tokens": 2}),
        Call("POST", C, json={"prompt": "\ud800 lone surrogate", "max_tokens": 2}),
        Call("POST", C, json={"prompt": "a" * 3_000_000, "max_tokens": 1}),
        Call("POST", C, json={"prompt": [[1, 2]] * 5000, "max_tokens": 1}),
        Call("POST", C, json={"prompt": [1] * 100_000, "max_tokens": 1}),
        Call("POST", C, json={"prompt": [2**64, 1], "max_tokens": 1}),
        Call("POST", C, json={"prompt": [[]], "max_tokens": 1}),
        Call("POST", C, json={"prompt": [["a"]], "max_tokens": 1}),
        Call("POST", C, json={"prompt": "hi", "stop": ["x"] * 10_000}),
        Call("POST", C, json={"prompt": "hi", "stop": "y" * 100_000}),
        Call("POST", C, json={"prompt": "hi", "stop_token_ids": list(range(100_000))}),
        Call("POST", C, json={"prompt": "hi", "logit_bias": {str(i): 1 for i in range(10_000)}}),
        Call("POST", C, json={"prompt": "hi", "n": 10**9}),
        Call("POST", C, json={"prompt": "hi", "best_of": 10**9}),
        Call("POST", C, json={"prompt": "hi", "logprobs": 10**9}),
        Call("POST", C, json={"prompt": "hi", "max_tokens": 10**30}),
        Call("POST", C, json={"prompt": "hi", "stream": "yes please"}),
        Call("POST", C, json={"prompt": "hi", "stream_options": {"include_usage": [1]}}),
        Call("POST", C, json={"prompt": "hi", "model": "../../../../etc/passwd"}),
        Call("POST", C, json={"prompt": "hi", "model": "/etc/passwd", "stream": True}),
        Call("POST", C, json={"prompt": "hi", "max_tokens": 3, "stream": True, "n": 3, "logprobs": 5, "echo": True}),
        Call("POST", C, json={"prompt": ["a", "b"], "max_tokens": 2, "stream": True, "stop": ["a", "b"]}),
        Call("POST", CH, json={"messages": "hi"}),
        Call("POST", CH, json={"messages": [None]}),
        Call("POST", CH, json={"messages": [{"role": 5, "content": "x"}]}),
        Call("POST", CH, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        Call("POST", CH, json={"messages": [{"role": "user", "content": {"nested": "object"}}]}),
        Call("POST", CH, json={"messages": [{"role": "user", "content": "x" * 3_000_000}]}),
        Call("POST", CH, json={"messages": msg * 20_000, "max_tokens": 1}),
        Call("POST", CH, json={"messages": msg, "chat_template_kwargs": {"tokenize": True, "x": [1] * 1000}}),
        Call("POST", CH, json={"messages": msg, "top_logprobs": 10**20, "logprobs": True}),
        Call("POST", CH, json={"messages": msg, "max_completion_tokens": -(2**70)}),
        Call("POST", CH, json={"messages": msg, "response_format": {"type": "json_schema"}}),
        Call("POST", CH, json={"messages": msg, "tools": [{"type": "function"}], "tool_choice": "auto"}),
        Call("POST", CH, json={"messages": msg, "continue_final_message": True}),
        Call("POST", CH, json={"messages": msg, "max_tokens": 3, "stream": True,
                               "stream_options": {"include_usage": True}}),
        Call("POST", "/tokenize", json={"prompt": "x" * 3_000_000}),
        Call("POST", "/tokenize", json={"prompt": "hi", "messages": msg}),
        Call("POST", "/tokenize", json={}),
        Call("POST", "/detokenize", json={"tokens": [-1]}),
        Call("POST", "/detokenize", json={"tokens": [2**63]}),
        Call("POST", "/detokenize", json={"tokens": "abc"}),
        Call("GET", "/v1/models/" + "%2e%2e%2f" * 20 + "etc/passwd"),
        Call("GET", "/v1/models/" + "a" * 10_000),
        Call("GET", "/v1/models/%00"),
        Call("DELETE", "/v1/models"),
        Call("PUT", C, json={"prompt": "hi"}),
        Call("GET", C),
        Call("GET", "/no/such/route"),
        Call("POST", C, json={"prompt": "hi", "max_tokens": 2}, headers={"content-length": "5"}),
        Call("GET", "/health", params={"x": "y" * 1000}),
    ]
    for c in calls:
        if isinstance(c.json, dict) and c.path in (C, CH):
            c.json.setdefault("model", model)
    return calls


@contextlib.contextmanager
def ieee_floats():
    """Hypothesis refuses to draw floats while subnormals flush to zero, which an in-process CPU
    engine turns on (torch.set_flush_denormal(True), per thread): off for this thread meanwhile."""
    torch = sys.modules.get("torch")
    engine_here = "pagedserve.engine.engine" in sys.modules
    if torch is not None:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if torch is not None and engine_here:
            torch.set_flush_denormal(True)


def schema_calls(openapi: dict, n: int, seed: int = 0) -> list[Call]:
    """About n requests drawn from the OpenAPI document: for every operation, valid and invalid."""
    with ieee_floats():
        return _schema_calls(openapi, n, seed)


def _schema_calls(openapi: dict, n: int, seed: int) -> list[Call]:
    import schemathesis
    from hypothesis import HealthCheck, given, settings, strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi)
    ops = [r.ok() for r in schema.get_all_operations()]
    per = max(1, n // (2 * len(ops)))
    out: list[Call] = []
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            drawn: list[Call] = []

            @settings(max_examples=per, database=None, deadline=None, derandomize=False,
                      suppress_health_check=list(HealthCheck))
            @given(st.data())
            def draw(data):
                c = data.draw(op.as_strategy(generation_mode=mode))
                body = c.body if type(c.body).__name__ != "NotSet" else NOT_SET
                headers = {k: str(v) for k, v in (c.headers or {}).items()
                           if k.lower() not in ("content-length", "host", "transfer-encoding")}
                content = None
                if isinstance(body, bytes) or (isinstance(body, str) and c.media_type and "json" not in c.media_type):
                    content = body.encode() if isinstance(body, str) else body  # raw bytes / another media type
                    headers["content-type"] = c.media_type or "application/octet-stream"
                    body = NOT_SET
                drawn.append(Call(c.method.upper(), c.formatted_path, json=body, content=content,
                                  params=dict(c.query or {}), headers=headers, source=f"{mode.value} {op.label}"))

            try:
                random.seed(seed)
                draw()
            except Exception as e:  # noqa: BLE001 - an operation schemathesis cannot draw for: say so
                print(f"note: no {mode.value} cases for {op.label}: {type(e).__name__}: {e}", file=sys.stderr)
            out += drawn
    return out


# TGI's routes answer in TGI's own error shape, {"error": message, "error_type": kind}: its clients expect it
TGI_ROUTES = ("/generate", "/generate_stream", "/")


def problem(resp, path: str = "") -> str | None:
    """Why this response breaks the promise, or None."""
    s = resp.status_code
    if s >= 500:
        return f"{s}: {resp.text[:300]}"
    ctype = resp.headers.get("content-type", "")
    if s >= 400 and path.split("?")[0] in TGI_ROUTES:
        try:
            body = resp.json()
            if isinstance(body.get("error"), str) and body["error"] and isinstance(body.get("error_type"), str):
                return None
        except Exception:  # noqa: BLE001
            pass
        return f"{s} without a TGI error body: {resp.text[:300]}"
    if s >= 400:
        try:
            err = resp.json()["error"]
            if not (isinstance(err.get("message"), str) and err["message"] and err.get("type")
                    and "param" in err and "code" in err):
                return f"{s} with an incomplete error body: {resp.text[:300]}"
        except Exception:  # noqa: BLE001
            return f"{s} without an OpenAI error body: {resp.text[:300]}"
    elif ctype.startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:]).get("error") or {}
                code = err.get("code")
                if isinstance(code, int) and code >= 500:
                    return f"in-band {code} error in a stream: {line[:300]}"
    return None


def pool_state(client) -> dict:
    """running / waiting / KV usage (and preemptions, prefix-cache hits) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    vals = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for smp in fam.samples:
            vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
    return {"running": vals.get("pagedserve:num_requests_running", -1),
            "waiting": vals.get("pagedserve:num_requests_waiting", -1),
            "kv_cache_usage": vals.get("pagedserve:kv_cache_usage_perc", -1),
            "preemptions": vals.get("pagedserve:num_preemptions_total", 0),
            "prefix_hits": vals.get("pagedserve:prefix_cache_hits_total", 0)}


def wait_idle(client, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = pool_state(client)
        if (st["running"], st["waiting"], st["kv_cache_usage"]) == (0, 0, 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def fuzz(client, n: int, seed: int = 0, model: str | None = None) -> dict:
    """Send about n cases (hand-written first, then schema-drawn); return the summary."""
    if model is None:
        model = client.get("/v1/models").json()["data"][0]["id"]
    openapi = client.get("/openapi.json").json()
    calls = hostile_calls(model)
    calls += schema_calls(openapi, max(0, n - len(calls)), seed)
    rng = random.Random(seed)
    if len(calls) < n:  # routes with few distinct cases: repeat drawn ones to reach n
        extra = [c for c in calls if c.source != "hostile"] or calls
        calls += [rng.choice(extra) for _ in range(n - len(calls))]
    calls = calls[:n] if n else calls
    by_status: collections.Counter = collections.Counter()
    routes: collections.Counter = collections.Counter()
    problems: list[dict] = []
    slowest: list[tuple[float, str]] = []
    client_errors: list[str] = []
    t0 = time.time()
    for c in calls:
        t1 = time.perf_counter()
        try:
            r = c.send(client)
        except Exception as e:  # noqa: BLE001 - a dropped connection or a client-side refusal
            by_status[f"client:{type(e).__name__}"] += 1
            client_errors.append(f"{c.method} {c.path} headers={str(c.headers)[:80]} params={str(c.params)[:80]}: {e}"[:300])
            if "Timeout" in type(e).__name__ or "RemoteProtocol" in type(e).__name__:
                problems.append({"call": f"{c.method} {c.path} ({c.source})", "problem": repr(e)[:300]})
            continue
        by_status[str(r.status_code)] += 1
        slowest = sorted(slowest + [(time.perf_counter() - t1, f"{c.method} {c.path} {str(c.json)[:80]}")])[-5:]
        routes[f"{c.method} {c.path.split('?')[0] if not c.path.startswith('/v1/models/') else '/v1/models/{id}'}"] += 1
        p = problem(r, c.path)
        if p:
            problems.append({"call": f"{c.method} {c.path} ({c.source})", "body": str(c.json)[:200], "problem": p})
    elapsed = time.time() - t0
    after = wait_idle(client)
    health = client.get("/health").status_code
    ok = client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}).status_code
    return {
        "requests": len(calls),
        "seconds": round(elapsed, 1),
        "by_status": dict(sorted(by_status.items())),
        "routes": dict(sorted(routes.items())),
        "n_5xx": sum(v for k, v in by_status.items() if k[:1] == "5"),
        "problems": problems[:50],
        "n_problems": len(problems),
        "client_errors": client_errors[:10],
        "slowest": [(round(t, 3), what) for t, what in reversed(slowest)],
        "after": {**after, "health": health, "completion_status": ok},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else --model starts one)")
    ap.add_argument("--model", help="model directory for a server started here")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import httpx

    srv = None
    if args.url is None:
        if not args.model:
            ap.error("give --url or --model")
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
        from server_utils import RemoteServer

        srv = RemoteServer(args.model, ["--max-model-len", args.max_model_len, "--disable-log-requests",
                                        "--uvicorn-log-level", "warning"]).wait_ready()
        args.url = srv.base_url
    try:
        with httpx.Client(base_url=args.url, timeout=120) as client:
            summary = fuzz(client, args.requests, args.seed)
    finally:
        if srv is not None:
            srv.stop()
    print(json.dumps(summary, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    a = summary["after"]
    good = (summary["n_5xx"] == 0 and summary["n_problems"] == 0 and a["running"] == 0 and a["waiting"] == 0
            and a["kv_cache_usage"] == 0 and a["health"] == 200 and a["completion_status"] == 200)
    print("PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
