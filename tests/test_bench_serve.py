"""Unit tests of `pagedserve bench serve`: metrics, goodput, datasets, SSE parsing, JSON schema, CLI.

No server here; tests/test_bench_serve_live.py runs it against the real one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedserve.bench import datasets, report, serve
from pagedserve.bench.report import RequestRecord

ROOT = Path(__file__).resolve().parents[1]


def _records() -> list[RequestRecord]:
    a = RequestRecord(index=0, prompt_len=10, output_len=5, expected_output_len=5, start=0.0, ttft=0.1,
                      itl=[0.1, 0.1, 0.1, 0.1], e2e=0.5, success=True, http_status=200, usage_reported=True, sent=True)
    b = RequestRecord(index=1, prompt_len=20, output_len=3, expected_output_len=3, start=0.2, ttft=0.2,
                      itl=[0.2, 0.2], e2e=0.6, success=True, http_status=200, usage_reported=True, sent=True)
    c = RequestRecord(index=2, prompt_len=7, expected_output_len=4, start=0.3, success=False,
                      error="HTTP 400: too long", http_status=400, sent=True)
    return [a, b, c]


# ------------------------------------------------------------------ metrics


def test_stats_exact_values():
    st = report.stats_ms([0.1, 0.2, 0.3, 0.4])
    assert st["mean"] == pytest.approx(250.0)
    assert st["median"] == pytest.approx(250.0)
    assert st["p90"] == pytest.approx(370.0)  # linear: 300 + 0.7 * 100
    assert st["p99"] == pytest.approx(397.0)
    assert st["min"] == pytest.approx(100.0) and st["max"] == pytest.approx(400.0)
    assert report.stats_ms([]) == {k: None for k in report.STAT_KEYS}


def test_tpot_per_request():
    a, b, c = _records()
    assert a.tpot == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert b.tpot == pytest.approx(0.2)  # (0.6 - 0.2) / (3 - 1)
    assert c.tpot is None
    one = RequestRecord(index=3, output_len=1, ttft=0.1, e2e=0.1, success=True)
    assert one.tpot is None


def test_summary_exact_values():
    out = report.summarize(_records(), duration_s=2.0)
    s, m = out["summary"], out["metrics"]
    assert (s["completed"], s["failed"], s["num_prompts"], s["not_sent"]) == (2, 1, 3, 0)
    assert s["errors"] == ["HTTP 400: too long"]
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(15.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["goodput"] is None and s["goodput_completed"] is None
    assert s["usage_reported"] is True
    assert s["max_concurrency_observed"] == 2
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(190.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert m["e2e_ms"]["mean"] == pytest.approx(550.0)
    assert m["e2e_ms"]["p99"] == pytest.approx(599.0)
    # ITL pools every gap: 4 x 100 ms and 2 x 200 ms
    assert m["itl_ms"]["mean"] == pytest.approx(800.0 / 6)
    assert m["itl_ms"]["median"] == pytest.approx(100.0)
    assert m["itl_ms"]["p90"] == pytest.approx(200.0)


def test_errors_are_distinct_and_capped():
    recs = [RequestRecord(index=i, success=False, error=f"HTTP 500: boom {i % 7}") for i in range(20)]
    s = report.summarize(recs, 1.0)["summary"]
    assert s["failed"] == 20 and s["completed"] == 0
    assert s["errors"] == [f"HTTP 500: boom {i}" for i in range(report.MAX_ERRORS_SHOWN)]
    assert s["request_throughput"] == 0.0


# ------------------------------------------------------------------ goodput


def test_parse_goodput():
    assert report.parse_goodput(["ttft:200", "tpot:50", "e2e:2000"]) == {"ttft": 200.0, "tpot": 50.0, "e2e": 2000.0}
    assert report.parse_goodput(["TTFT:1.5,e2e:10"]) == {"ttft": 1.5, "e2e": 10.0}
    assert report.parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2e:0"]):
        with pytest.raises(ValueError):
            report.parse_goodput(bad)


def test_goodput_values():
    recs = _records()
    s = report.summarize(recs, 2.0, {"ttft": 150})["summary"]
    assert s["goodput_completed"] == 1 and s["goodput"] == pytest.approx(0.5)
    s = report.summarize(recs, 2.0, {"tpot": 150})["summary"]
    assert s["goodput_completed"] == 1
    s = report.summarize(recs, 2.0, {"e2e": 550})["summary"]
    assert s["goodput_completed"] == 1
    s = report.summarize(recs, 2.0, {"ttft": 250, "tpot": 250, "e2e": 1000})["summary"]
    assert s["goodput_completed"] == 2 and s["goodput"] == pytest.approx(1.0)
    s = report.summarize(recs, 2.0, {"ttft": 250, "tpot": 150})["summary"]
    assert s["goodput_completed"] == 1  # every SLO must hold
    one = RequestRecord(index=0, output_len=1, ttft=0.01, e2e=0.01, success=True)
    assert report.meets_slos(one, {"tpot": 1.0, "ttft": 20})  # no TPOT to miss
    assert not report.meets_slos(recs[2], {"e2e": 1e9})  # failed never counts


# ------------------------------------------------------------------ datasets


def test_sample_lengths_range_and_bounds():
    rng = np.random.default_rng(0)
    lens = datasets.sample_lengths(rng, 2000, 100, 0.25)
    assert lens.min() >= 75 and lens.max() <= 125
    assert lens.min() == 75 and lens.max() == 125  # both ends reachable
    assert (datasets.sample_lengths(rng, 10, 100, 0.0) == 100).all()
    assert (datasets.sample_lengths(rng, 10, 1, 0.9) >= 1).all()
    with pytest.raises(ValueError):
        datasets.sample_lengths(rng, 1, 10, 1.0)


def test_random_dataset_ids_reproducible():
    a = datasets.random_dataset(20, 32, 8, range_ratio=0.5, vocab_size=384, seed=7)
    b = datasets.random_dataset(20, 32, 8, range_ratio=0.5, vocab_size=384, seed=7)
    c = datasets.random_dataset(20, 32, 8, range_ratio=0.5, vocab_size=384, seed=8)
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    for r in a:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 16 <= r.prompt_len <= 48 and 4 <= r.output_len <= 12
        assert all(datasets.MIN_TOKEN_ID <= t < 384 for t in r.prompt)
    assert len({tuple(r.prompt) for r in a}) == 20
    fixed = datasets.random_dataset(5, 32, 8, vocab_size=384, seed=0)
    assert all(r.prompt_len == 32 and len(r.prompt) == 32 and r.output_len == 8 for r in fixed)


def test_random_dataset_text():
    a = datasets.random_dataset(5, 16, 4, as_text=True, seed=1)
    assert a == datasets.random_dataset(5, 16, 4, as_text=True, seed=1)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 16 for r in a)


def test_shared_prefix_dataset():
    reqs = datasets.shared_prefix_dataset(6, 40, 10, 4, vocab_size=384, seed=3)
    prefix = reqs[0].prompt[:40]
    for r in reqs:
        assert r.prompt[:40] == prefix
        assert len(r.prompt) == r.prompt_len == 50 and r.output_len == 4
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 6
    groups = datasets.shared_prefix_dataset(6, 40, 10, 4, num_groups=2, vocab_size=384, seed=3)
    assert groups[0].prompt[:40] == groups[2].prompt[:40] != groups[1].prompt[:40]
    text = datasets.shared_prefix_dataset(3, 12, 5, 4, as_text=True, seed=0)
    words = [r.prompt.split() for r in text]
    assert all(w[:12] == words[0][:12] and len(w) == 17 for w in words)


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there world", "output_len": 5}\n\n{"prompt": [5, 6, 7]}\n')
    reqs = datasets.jsonl_dataset(f, 5, default_output_len=9)
    assert [r.output_len for r in reqs] == [5, 9, 5, 9, 5]
    assert reqs[0].prompt == "hello there world" and reqs[0].prompt_len == 3
    assert reqs[1].prompt == [5, 6, 7] and reqs[1].prompt_len == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.jsonl_dataset(bad, 1, 4)


# ------------------------------------------------------------------ SSE and payloads


def test_parse_sse_line():
    assert serve.parse_sse_line(b": ping") is None
    assert serve.parse_sse_line(": ping\r\n") is None
    assert serve.parse_sse_line(b"") is None
    assert serve.parse_sse_line(b"\r") is None
    assert serve.parse_sse_line("event: message") is None
    assert serve.parse_sse_line(b"data: [DONE]") == "[DONE]"
    assert serve.parse_sse_line(b"data:[DONE]\r\n") == "[DONE]"
    assert serve.parse_sse_line(b'data: {"choices": [{"text": "hi"}]}\r') == {"choices": [{"text": "hi"}]}
    assert serve.parse_sse_line('data:{"a":1}') == {"a": 1}
    with pytest.raises(ValueError):
        serve.parse_sse_line(b"data: {not json")


class _FakeStream:
    def __init__(self, chunks):
        self.chunks = chunks

    async def iter_any(self):
        for c in self.chunks:
            yield c


def test_iter_sse_lines_across_chunk_boundaries():
    body = b': ping\n\ndata: {"choices": [{"text": "a"}]}\r\n\r\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]'
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]

    async def collect():
        return [serve.parse_sse_line(x) async for x in serve.iter_sse_lines(_FakeStream(pieces))]

    parsed = [p for p in asyncio.run(collect()) if p is not None]
    assert parsed == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, "[DONE]"]


def test_chunk_text_and_error():
    assert serve.chunk_text({"choices": [{"text": "x"}]}, chat=False) == "x"
    assert serve.chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True) == ""
    assert serve.chunk_text({"choices": [{"delta": {"content": "y"}}]}, chat=True) == "y"
    assert serve.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) == ""
    assert serve.chunk_error({"error": {"message": "bad"}}) == "bad"
    assert serve.chunk_error({"object": "error", "message": "worse"}) == "worse"
    assert serve.chunk_error({"choices": []}) is None


def _args(**kw):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_build_payload():
    args = _args()
    ids = datasets.SampleRequest([5, 6, 7], 3, 8)
    body = serve.build_payload(ids, "m", serve.COMPLETIONS, args)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 8 and body["model"] == "m"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    chat = serve.build_payload(datasets.SampleRequest("hi there", 2, 4), "m", serve.CHAT, _args(ignore_eos=False))
    assert chat["messages"] == [{"role": "user", "content": "hi there"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError):
        serve.build_payload(ids, "m", serve.CHAT, args)


def test_arrival_delays():
    assert (serve.arrival_delays(5, float("inf"), "poisson", 1.0, 0) == 0).all()
    c = serve.arrival_delays(5, 4.0, "constant", 1.0, 0)
    assert c.tolist() == [0.0, 0.25, 0.25, 0.25, 0.25]
    p = serve.arrival_delays(4000, 10.0, "poisson", 1.0, 0)
    assert p[0] == 0.0 and abs(p[1:].mean() - 0.1) < 0.01
    assert (p == serve.arrival_delays(4000, 10.0, "poisson", 1.0, 0)).all()
    bursty = serve.arrival_delays(4000, 10.0, "poisson", 0.25, 0)
    assert abs(bursty[1:].mean() - 0.1) < 0.015 and bursty[1:].std() > p[1:].std()


# ------------------------------------------------------------------ result JSON, table, plot

SUMMARY_KEYS = {
    "duration_s", "num_prompts", "completed", "failed", "not_sent", "errors", "timed_out",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_token_throughput", "goodput_slos_ms", "goodput_completed", "goodput",
    "usage_reported", "max_concurrency_observed",
}
RECORD_KEYS = {
    "index", "prompt_len", "output_len", "expected_output_len", "start", "ttft", "itl", "e2e", "tpot",
    "success", "error", "http_status", "usage_reported", "sent", "end",
}


def check_result_schema(res: dict) -> None:
    """The stable result-JSON schema (shared with the live test)."""
    assert set(res) == {"schema_version", "config", "summary", "metrics", "requests"}
    assert res["schema_version"] == report.SCHEMA_VERSION
    assert set(res["summary"]) == SUMMARY_KEYS
    assert set(res["metrics"]) == {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}
    for st in res["metrics"].values():
        assert set(st) == set(report.STAT_KEYS)
    assert len(res["requests"]) == res["summary"]["num_prompts"]
    for r in res["requests"]:
        assert set(r) == RECORD_KEYS
    for k in ("base_url", "endpoint", "model", "dataset", "num_prompts", "request_rate", "max_concurrency", "seed"):
        assert k in res["config"]


def test_result_json_schema(tmp_path):
    args = _args(num_prompts=3)
    cfg = serve.config_dict(args, "m", 384, "ids")
    res = report.build_result(cfg, _records(), 2.0, {"ttft": 150})
    path = tmp_path / "r.json"
    report.write_json(res, str(path))
    back = json.loads(path.read_text())
    check_result_schema(back)
    assert back["config"]["request_rate"] == "inf"
    assert back["requests"][0]["itl"] == [0.1, 0.1, 0.1, 0.1]
    assert back["requests"][2]["error"] == "HTTP 400: too long" and back["requests"][2]["success"] is False
    assert back["summary"]["goodput"] == pytest.approx(0.5)


def test_table_and_plot(tmp_path):
    res = report.build_result(serve.config_dict(_args(), "m", 384, "ids"), _records(), 2.0, {"e2e": 550})
    table = report.format_table(res)
    for line in ("Successful requests:", "Failed requests:", "Request goodput (req/s):", "P99 TTFT (ms):",
                 "Median TPOT (ms):", "Mean ITL (ms):", "P90 E2E (ms):", "HTTP 400: too long"):
        assert line in table
    empty = report.build_result({}, [RequestRecord(index=0, error="x")], 1.0)
    assert "n/a" in report.format_table(empty)
    png = tmp_path / "p.png"
    report.plot(res, _records(), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_timeline_conserves_tokens():
    recs = _records()
    x, tok, req = report.throughput_timeline(recs, 2.0, bins=10)
    width = 0.2
    assert (tok * width).sum() == pytest.approx(8.0)
    assert (req * width).sum() == pytest.approx(2.0)


# ------------------------------------------------------------------ CLI


def test_help():
    out = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--base-url", "--model", "--endpoint", "--api-key", "--dataset", "--num-prompts",
                 "--random-input-len", "--random-output-len", "--random-range-ratio", "--shared-prefix-len",
                 "--request-rate", "--burstiness", "--arrival", "--max-concurrency", "--goodput", "--seed",
                 "--result-json", "--plot", "--timeout", "--request-timeout", "--ignore-eos"):
        assert flag in out.stdout
    out = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout and "throughput" in out.stdout


def test_bench_serve_does_not_import_torch():
    code = (
        "import sys; from pagedserve.cli import build_parser; "
        "a = build_parser(only='bench').parse_args(['bench', 'serve', '--num-prompts', '3']); "
        "from pagedserve.bench import serve, report; "
        "assert a.num_prompts == 3 and a.func is not None; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_unreachable_server_is_a_clean_error():
    args = _args(base_url="http://127.0.0.1:9", num_prompts=1, disable_tqdm=True)
    assert serve.run(args) == 2  # no model given and /v1/models unreachable


def test_bad_config_rejected():
    assert serve.run(_args(model="m", vocab_size=100, num_prompts=0)) == 2
    assert serve.run(_args(model="m", vocab_size=100, random_range_ratio=1.5, num_prompts=1)) == 2


def test_requests_cut_by_the_run_timeout_count_as_in_flight():
    """A run stopped by --timeout with every request still streaming printed "Max concurrent
    requests seen: 0": only completed requests were counted."""
    cut = [RequestRecord(index=i, start=0.01 * i, sent=True, end=5.0, error="stopped by --timeout before it finished")
           for i in range(64)]
    s = report.summarize(cut, duration_s=5.0, timed_out=True)["summary"]
    assert s["max_concurrency_observed"] == 64
    # a request that failed fast ends when it failed, not at the end of the run
    quick = [RequestRecord(index=i, start=float(i), sent=True, end=i + 0.1, error="HTTP 400: bad") for i in range(5)]
    assert report.summarize(quick, duration_s=5.0)["summary"]["max_concurrency_observed"] == 1


def test_most_requests_failing_is_explained_in_one_line():
    recs = [RequestRecord(index=i, sent=True, end=0.1, error='HTTP 401: {"error": "bad key"}') for i in range(3)]
    line = report.failure_line(report.build_result({}, recs, 1.0, {}))
    assert line.startswith("bench serve: 3 of 3 requests failed") and "--api-key" in line
    assert report.failure_line(report.build_result({}, _records(), 1.0, {})) is None  # 1 of 3 failed


def test_a_server_that_wants_a_key_says_pass_api_key(capsys):
    from aiohttp import web

    async def main():
        app = web.Application()
        app.router.add_get("/v1/models", lambda r: web.json_response({"error": {"message": "bad key"}}, status=401))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            args = _args(base_url=f"http://127.0.0.1:{port}", num_prompts=1, disable_tqdm=True)
            return await serve._main(args)
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "--api-key" in err and "--model" not in err
