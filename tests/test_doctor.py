"""`pagedserve doctor` against real servers driven into each symptom of the tuning table:
a tiny KV pool (preemptions), long prompts with chunked prefill off (slow TTFT), more clients
than --max-num-seqs (queue backlog); and `doctor --bench` on a real `bench serve` result.

The three servers start together (one load time for the module). The TTFT target is set to 1 ms
because the tiny model prefills in milliseconds: what is asserted is the cause the doctor names.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from server_utils import RemoteServer

from pagedserve.cli import main

COMMON = ["--num-threads", 1, "--seed", 0, "--disable-log-requests", "--block-size", 16]
CONFIGS = {
    # 12 blocks of 16 tokens: one 128-token sequence fits, two 100-token requests overflow it
    "tiny_kv": ["--max-model-len", 128, "--num-gpu-blocks-override", 12, "--max-num-seqs", 8],
    # whole-prompt prefill: one 300-token prompt per step
    "no_chunking": ["--max-model-len", 512, "--num-gpu-blocks-override", 256, "--no-enable-chunked-prefill"],
    # two sequences at a time, plenty of KV
    "two_seqs": ["--max-model-len", 256, "--num-gpu-blocks-override", 256, "--max-num-seqs", 2],
}


@pytest.fixture(scope="module")
def servers(llama_dir):
    started = {k: RemoteServer(llama_dir, [*COMMON, *v]) for k, v in CONFIGS.items()}
    try:
        yield {k: s.wait_ready(timeout=600) for k, s in started.items()}  # a shared host loads slowly
    finally:
        for s in started.values():
            s.stop()


@contextlib.contextmanager
def load(server, prompt: str, max_tokens: int, clients: int):
    """`clients` threads sending completions back to back until the block ends."""
    stop = threading.Event()
    errors = []

    def loop():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(server.url("/v1/completions"), json={"prompt": prompt, "max_tokens": max_tokens,
                                                                "temperature": 0.0, "ignore_eos": True})
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # let the load build up before the window opens
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors[:2]


def doctor(capsys, *argv) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["doctor", *map(str, argv), "--json"])
    out = json.loads(capsys.readouterr().out)
    return rc, out


def ids(report: dict) -> set[str]:
    return {d["id"] for d in report["diagnoses"]}


def by_id(report: dict, key: str) -> dict:
    return next(d for d in report["diagnoses"] if d["id"] == key)


def test_tiny_kv_pool_is_diagnosed_as_preemptions(servers, capsys):
    srv = servers["tiny_kv"]
    with load(srv, "Once upon a time there was", 100, clients=4):
        rc, rep = doctor(capsys, "--url", srv.base_url, "--window", 4, "--interval", 0.25)
    assert rc == 1 and "preemptions" in ids(rep), rep
    d = by_id(rep, "preemptions")
    assert rep["stats"]["preemptions"] > 0 and rep["stats"]["kv_max"] > 0.8
    assert d["change"].startswith("--num-gpu-blocks-override 24 (now 12)")
    assert any("preemptions in" in e for e in d["evidence"])


def test_long_prompts_without_chunked_prefill_are_diagnosed_as_slow_ttft(servers, capsys):
    srv = servers["no_chunking"]
    prompt = " ".join(["Once upon a time there was a little girl"] * 13)  # ~300 tokens
    with load(srv, prompt, 4, clients=3):
        rc, rep = doctor(capsys, "--url", srv.base_url, "--window", 4, "--interval", 0.25, "--ttft-slo-ms", 1)
    assert rc == 1 and "slow_ttft_long_prompts" in ids(rep), rep
    d = by_id(rep, "slow_ttft_long_prompts")
    assert d["change"] == "--enable-chunked-prefill --max-num-batched-tokens 2048"
    assert rep["config"]["enable_chunked_prefill"] is False and rep["stats"]["prompt_len_mean"] >= 256
    assert "preemptions" not in ids(rep)


def test_more_clients_than_max_num_seqs_is_diagnosed_as_queue_backlog(servers, capsys):
    srv = servers["two_seqs"]
    with load(srv, "The quick brown fox", 32, clients=8):
        rc, rep = doctor(capsys, "--url", srv.base_url, "--window", 4, "--interval", 0.25, "--ttft-slo-ms", 1)
    assert rc == 1 and "queue_backlog" in ids(rep), rep
    d = by_id(rep, "queue_backlog")
    assert d["change"].startswith("--max-num-seqs 4 (now 2)")
    assert rep["stats"]["running_max"] == 2 and rep["stats"]["waiting_max"] >= 1
    # chunked prefill is on and prompts are short: the long-prompt advice must not appear
    assert not ids(rep) & {"slow_ttft_long_prompts", "preemptions"}


def test_idle_server_is_healthy_and_text_output(servers, capsys):
    srv = servers["two_seqs"]
    capsys.readouterr()
    rc = main(["doctor", "--url", srv.base_url, "--window", "0.5", "--interval", "0.25"])
    out = capsys.readouterr().out
    assert rc == 0 and "No problems found." in out and srv.base_url in out
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--window", "0.5"]) == 2
    assert "error:" in capsys.readouterr().err


def test_doctor_reads_a_bench_serve_result(servers, capsys, tmp_path):
    srv = servers["two_seqs"]
    result = tmp_path / "s1.json"
    # a warm-up run first: the first steps after start are slow, and a slow first request raises the
    # fastest TTFT the diagnosis compares with. Long outputs make each wave of 2 hold the 4 waiting
    # requests for many steps, so their TTFTs stand well apart from the fastest one's.
    common = ["bench", "serve", "--base-url", srv.base_url, "--random-input-len", "16", "--ignore-eos",
              "--disable-tqdm"]
    assert main([*common, "--num-prompts", "2", "--random-output-len", "4"]) == 0
    rc = main([*common, "--num-prompts", "12", "--max-concurrency", "6", "--random-output-len", "96",
               "--result-json", str(result)])
    assert rc == 0
    rc, rep = doctor(capsys, "--bench", result, "--url", srv.base_url)
    assert rc == 1 and "queue_backlog" in ids(rep), rep
    assert by_id(rep, "queue_backlog")["change"].startswith("--max-num-seqs 6 (now 2)")
