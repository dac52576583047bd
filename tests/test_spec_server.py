"""Speculative decoding behind the HTTP server: vLLM's spec_decode_* metrics, bench serve's report."""
import json
import subprocess
import sys

import httpx
import pytest

from pagedserve.engine.async_engine import _spec_log_line
from pagedserve.spec.decoder import SpecStats
from server_utils import REPO, RemoteServer, metric

P = "pagedserve:"


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = RemoteServer(llama_dir, ["--max-model-len", 512, "--num-gpu-blocks-override", 256, "--num-threads", 1,
                                   "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_metrics_count_drafts_and_bench_serve_reports_acceptance(server, tmp_path):
    prompt = list(range(20, 60)) * 3  # repeats itself: prompt lookup drafts from the first step
    r = httpx.post(server.url("/v1/completions"), json={"model": server_model(server), "prompt": prompt,
                                                        "max_tokens": 24, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    m = server.metrics()
    drafts = metric(m, P + "spec_decode_num_drafts_total")
    drafted = metric(m, P + "spec_decode_num_draft_tokens_total")
    accepted = metric(m, P + "spec_decode_num_accepted_tokens_total")
    per_pos = [metric(m, P + "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--base-url", server.base_url,
                           "--dataset", "random", "--num-prompts", "6", "--random-input-len", "32",
                           "--random-output-len", "16", "--seed", "0", "--disable-tqdm", "--result-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())["spec_decode"]
    after = server.metrics()
    assert res["num_drafts"] == metric(after, P + "spec_decode_num_drafts_total") - drafts
    assert res["num_accepted_tokens"] == metric(after, P + "spec_decode_num_accepted_tokens_total") - accepted
    assert "Draft acceptance rate (%):" in proc.stdout and "Mean acceptance length:" in proc.stdout


def server_model(server) -> str:
    return httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]


def test_log_line_gives_the_interval_mean_acceptance_length():
    before, now = SpecStats(3), SpecStats(3)
    before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens = 10, 30, 5
    now.num_drafts, now.num_draft_tokens, now.num_accepted_tokens = 30, 90, 45
    line = _spec_log_line(now, before)
    assert "Mean acceptance length: 3.00" in line and "Draft acceptance rate: 66.7%" in line
