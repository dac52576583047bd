"""`pagedserve bench serve` against our real OpenAI-compatible server on loopback (tiny random Llama).

The server runs in a subprocess; bench serve runs as the user would run it (`python -m pagedserve
bench serve ...`) and its result JSON is checked for consistent numbers and the stable schema.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_bench_serve import check_result_schema

ROOT = Path(__file__).resolve().parents[1]
SERVER_MODULE = "pagedserve.entrypoints.openai.api_server"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 180


def _server_available() -> bool:
    try:
        return importlib.util.find_spec(SERVER_MODULE) is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _server_available(), reason=f"{SERVER_MODULE} is not in this checkout yet")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("bench-live") / "server.log"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [
        sys.executable, "-m", SERVER_MODULE,
        "--model", str(llama_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-gpu-blocks-override", "512",
    ]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy in {STARTUP_TIMEOUT_S}s:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _bench(base: str, tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out_json = tmp_path / f"{name}.json"
    cmd = [
        sys.executable, "-m", "pagedserve", "bench", "serve",
        "--base-url", base,
        "--seed", "0",
        "--timeout", "240",
        "--request-timeout", "120",
        "--disable-tqdm",
        "--result-json", str(out_json),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out_json.exists(), f"no result JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out_json.read_text())


def _check_latencies(res: dict) -> None:
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = res["metrics"][name]
        assert st["p99"] >= st["median"] >= 0, (name, st)
        assert st["max"] >= st["p99"] and st["p90"] >= st["median"] and st["min"] >= 0, (name, st)
    for r in res["requests"]:
        assert r["success"] and r["error"] is None and r["http_status"] == 200
        assert 0 <= r["ttft"] <= r["e2e"]
        assert len(r["itl"]) <= r["output_len"] - 1
        assert r["usage_reported"] is True


def test_bench_serve_completions(server, tmp_path):
    n, inp, outp = 12, 32, 8
    png = tmp_path / "plot.png"
    proc, res = _bench(
        server, tmp_path, "ok",
        "--num-prompts", str(n), "--random-input-len", str(inp), "--random-output-len", str(outp),
        "--max-concurrency", "4", "--goodput", "e2e:600000", "--plot", str(png),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successful requests:" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    check_result_schema(res)
    s = res["summary"]
    assert s["num_prompts"] == n and s["completed"] == n and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == n * outp  # from usage, with ignore_eos
    assert s["total_input_tokens"] == n * inp  # token-id prompts: exactly the ids sent
    assert [r["output_len"] for r in res["requests"]] == [outp] * n
    assert s["duration_s"] > 0
    for k in ("request_throughput", "input_throughput", "output_throughput", "total_token_throughput"):
        assert s[k] > 0, k
    assert s["output_throughput"] == pytest.approx(n * outp / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # a 10-minute SLO: all meet it
    assert 1 <= s["max_concurrency_observed"] <= 4
    _check_latencies(res)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_chat(server, tmp_path):
    proc, res = _bench(
        server, tmp_path, "chat",
        "--endpoint", "/v1/chat/completions",
        "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4", "--request-rate", "50",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_result_schema(res)
    s = res["summary"]
    assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == 16
    assert all(r["prompt_len"] > 0 for r in res["requests"])  # counted by the server
    _check_latencies(res)


def test_bench_serve_counts_rejected_requests(server, tmp_path):
    n = 4
    proc, res = _bench(
        server, tmp_path, "bad",
        "--num-prompts", str(n), "--random-input-len", "32", "--random-output-len", str(MAX_MODEL_LEN + 100),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some requests failed
    check_result_schema(res)
    s = res["summary"]
    assert s["completed"] == 0 and s["failed"] == n and s["not_sent"] == 0
    assert s["errors"] and s["errors"][0].startswith("HTTP 400")
    assert "HTTP 400" in proc.stdout  # the table shows the first errors
    for r in res["requests"]:
        assert r["success"] is False and r["http_status"] == 400 and r["error"].startswith("HTTP 400")
    assert s["request_throughput"] == 0.0 and s["total_output_tokens"] == 0
