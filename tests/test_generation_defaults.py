"""`--generation-config`: the model's generation_config.json fills the sampling fields a request
leaves out (server, Python API), a request's own values win, and the defaults are logged at start."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.generation_defaults import EMBEDDED_MODEL_DEFAULTS, generation_defaults
from server_utils import RemoteServer


@pytest.fixture(scope="module")
def model_with_defaults(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.0, "top_p": 0.5, "max_new_tokens": 5}))
    return d


def test_settings_and_sources(model_with_defaults, llama_dir, tmp_path):
    assert generation_defaults("auto", str(model_with_defaults))[0] == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    assert generation_defaults("vllm", str(model_with_defaults)) == ({}, "--generation-config vllm")
    assert generation_defaults(str(model_with_defaults), str(llama_dir))[0]["max_tokens"] == 5
    assert generation_defaults("auto", None)[0] == EMBEDDED_MODEL_DEFAULTS  # the embedded model: its authors' settings
    with pytest.raises(ConfigError, match="--generation-config"):
        generation_defaults(str(tmp_path / "missing"), None)


def test_python_api_uses_the_defaults_unless_given_params(model_with_defaults):
    llm = LLM(model=str(model_with_defaults), num_gpu_blocks_override=64, max_model_len=256)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.max_tokens) == (0.0, 0.5, 5)
    out = llm.generate(["Once upon a time"])[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    assert len(llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids) <= 3
    plain = LLM(model=str(model_with_defaults), num_gpu_blocks_override=64, max_model_len=256, generation_config="vllm")
    d = plain.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.max_tokens) == (1.0, 1.0, SamplingParams().max_tokens)


def test_server_fills_only_the_fields_a_request_leaves_out(model_with_defaults):
    srv = RemoteServer(model_with_defaults, ["--max-model-len", 256, "--num-gpu-blocks-override", 64]).wait_ready()
    try:
        url = srv.base_url + "/v1/completions"
        body = {"model": str(model_with_defaults), "prompt": "Once upon a time", "ignore_eos": True}
        bare = httpx.post(url, json=body, timeout=60).json()
        greedy = httpx.post(url, json={**body, "temperature": 0, "max_tokens": 5}, timeout=60).json()
        assert bare["usage"]["completion_tokens"] == 5  # the model's max_new_tokens
        assert bare["choices"][0]["text"] == greedy["choices"][0]["text"]  # its temperature 0.0: greedy
        own = httpx.post(url, json={**body, "max_tokens": 7}, timeout=60).json()
        assert own["usage"]["completion_tokens"] == 7  # a request's own value wins
        chat = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": str(model_with_defaults), "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 5
        assert "default sampling parameters: temperature=0.0, top_p=0.5, max_tokens=5" in srv.log()
    finally:
        srv.stop()


def test_bad_setting_is_one_line_at_start(llama_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "--model", str(llama_dir), "--prompt", "hi",
                        "--generation-config", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--generation-config" in r.stderr and "Traceback" not in r.stderr
