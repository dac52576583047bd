"""Engine faults across the process boundary: `pagedserve serve` runs the engine core in its own
process; a step that raises fails only that step's requests; a killed or hung core fails the
in-flight requests with a clear error, /health turns 503 within a second, and the server either
starts the core again (--restart-engine-on-failure) or exits 1.

Faults come from the engine's own test hook (PAGEDSERVE_FAULT_INJECTION, engine/fault_injection.py):
a prompt whose first token is RAISE / HANG makes the real model step raise / block.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from server_utils import RemoteServer, metric

RAISE, HANG = 77, 78
ARGS = ["--max-model-len", 256, "--num-gpu-blocks-override", 64, "--block-size", 16, "--num-threads", 1,
        "--seed", 0, "--disable-log-requests"]
# (oneDNN linears: a restart loads the model again, and should not wait on a native GEMM build)
FAULTS = {"PAGEDSERVE_FAULT_INJECTION": f"raise:{RAISE},hang:{HANG}", "PAGEDSERVE_CPU_GEMM": "onednn"}


@pytest.fixture(scope="module")
def servers(llama_dir):
    # both start now and load side by side
    restarting = RemoteServer(llama_dir, [*ARGS, "--restart-engine-on-failure", "--engine-step-timeout", 3],
                              env=FAULTS)
    exiting = RemoteServer(llama_dir, ARGS, env=FAULTS)
    try:
        yield restarting.wait_ready(), exiting.wait_ready()
    finally:
        restarting.stop()
        exiting.stop()


def core_pids(srv) -> list[int]:
    return [int(p) for p in re.findall(r"engine core (?:running|restarted) in process (\d+)", srv.log(tail=10**6))]


def completion(srv, prompt, max_tokens=4, timeout=60, **kw):
    body = {"model": model_name(srv), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}
    return httpx.post(srv.url("/v1/completions"), json=body, timeout=timeout)


def model_name(srv) -> str:
    return httpx.get(srv.url("/v1/models"), timeout=10).json()["data"][0]["id"]


def wait_health(srv, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(srv.url("/health"), timeout=1).status_code == status:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"/health did not answer {status} within {timeout}s:\n{srv.log()}")


def wait_kv_empty(srv, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if metric(m, "pagedserve:kv_cache_usage_perc") == 0 and metric(m, "pagedserve:num_requests_running") == 0:
            return
        assert time.monotonic() < deadline, "KV blocks still held"
        time.sleep(0.05)


def test_engine_core_runs_in_its_own_process(servers):
    srv, _ = servers
    pid = core_pids(srv)[-1]
    assert pid != srv.proc.pid and os.path.exists(f"/proc/{pid}")
    r = completion(srv, "Once upon a time")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_failing_step_fails_its_requests_and_the_engine_serves_on(servers):
    srv, _ = servers
    r = completion(srv, [RAISE, 5, 6])
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_step_failed" and "InjectedFault" in err["message"]
    # streamed: the error arrives in-band, then [DONE]
    with httpx.stream("POST", srv.url("/v1/completions"), timeout=30,
                      json={"model": model_name(srv), "prompt": [RAISE, 9], "max_tokens": 3, "stream": True}) as s:
        body = "".join(s.iter_text())
    assert "engine_step_failed" in body and body.rstrip().endswith("data: [DONE]")
    assert httpx.get(srv.url("/health")).status_code == 200
    ok = completion(srv, "The quick brown fox", max_tokens=5)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    wait_kv_empty(srv)


def test_hung_step_and_killed_core_are_restarted(servers):
    srv, _ = servers
    # a step that never returns: past --engine-step-timeout (3 s) the request fails with 503
    t0 = time.monotonic()
    r = completion(srv, [HANG, 5], timeout=30)
    assert r.status_code == 503 and "engine-step-timeout" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10
    wait_health(srv, 200, timeout=240)  # a fresh core
    assert completion(srv, "hello again").status_code == 200

    # kill the core mid-stream: the stream ends with an error, /health is 503 within a second
    pid = core_pids(srv)[-1]
    with httpx.stream("POST", srv.url("/v1/completions"), timeout=30,
                      json={"model": model_name(srv), "prompt": "Once upon a time", "max_tokens": 200,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGKILL)
        assert wait_health(srv, 503, timeout=1.0) < 1.0
        rest = "\n".join(lines)
    assert "engine_dead" in rest and rest.rstrip().endswith("data: [DONE]")
    wait_health(srv, 200, timeout=240)
    assert core_pids(srv)[-1] != pid
    r = completion(srv, "The cat sleeps", max_tokens=6)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    wait_kv_empty(srv)


def test_killed_core_without_restart_exits_1(servers):
    _, srv = servers
    pid = core_pids(srv)[-1]
    os.kill(pid, signal.SIGKILL)
    assert wait_health(srv, 503, timeout=1.0) < 1.0
    r = completion(srv, "hi")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert srv.proc.wait(timeout=30) == 1
    assert "the engine failed" in srv.log()


def test_api_server_count_2_shares_the_port_and_the_core(llama_dir):
    import concurrent.futures

    srv = RemoteServer(llama_dir, [*ARGS, "--api-server-count", 2], env={"PAGEDSERVE_CPU_GEMM": "onednn"})
    try:
        srv.wait_ready(timeout=300)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda i: completion(srv, f"story number {i}", max_tokens=5), range(8)))
        assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5 for r in rs)
        # two uvicorn front ends, one engine core. /health answers as soon as the first front end
        # is up; the second may still be starting (slow on a busy host), so wait for its line.
        deadline = time.monotonic() + 120
        while True:
            front_ends = set(re.findall(r"Started server process \[(\d+)\]", srv.log(tail=10**6)))
            if len(front_ends) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(front_ends) == 2 and len(set(core_pids(srv))) == 1, srv.log()
        srv.terminate()
        assert srv.proc.wait(timeout=60) == 0, srv.log()
    finally:
        srv.stop()
