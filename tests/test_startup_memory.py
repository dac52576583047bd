"""Start-up KV sizing on the CPU: the pool is capped to the memory available at start, and when not
even one max_model_len sequence fits, start-up fails with the length to use (never an OOM later)."""
from __future__ import annotations

import logging

import pytest

from pagedserve import LLM
from pagedserve.errors import ConfigError
from pagedserve.runner import host_memory
from pagedserve.runner.kv_cache import bytes_per_block

GiB = 1 << 30


def test_budget_is_capped_to_available_memory_minus_a_reserve():
    assert host_memory.kv_budget_bytes(4 * GiB, None) == (4 * GiB, None)
    assert host_memory.kv_budget_bytes(1 * GiB, 64 * GiB) == (1 * GiB, None)
    budget, note = host_memory.kv_budget_bytes(4 * GiB, 2 * GiB)
    assert budget == 2 * GiB - GiB // 2 and "only 2.00 GiB" in note
    budget, _ = host_memory.kv_budget_bytes(64 * GiB, 32 * GiB)
    assert budget == 32 * GiB - int(32 * GiB * 0.1)
    assert host_memory.kv_budget_bytes(GiB, GiB // 4)[0] == 0
    avail = host_memory.available_bytes()
    assert avail is None or avail > 0


def test_engine_sizes_the_pool_to_what_is_available(llama_dir, monkeypatch, caplog):
    llm0 = LLM(model=str(llama_dir), max_model_len=128, num_threads=1, kv_cache_space=0.001)
    spec, dtype = llm0.llm_engine.spec, llm0.llm_engine.dtype
    bpb = bytes_per_block(spec, 16, dtype)
    del llm0
    # 40 blocks' worth left after the reserve
    monkeypatch.setattr(host_memory, "available_bytes", lambda: GiB // 2 + 40 * bpb)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        llm = LLM(model=str(llama_dir), max_model_len=128, num_threads=1, kv_cache_space=4.0)
    assert llm.llm_engine.block_manager.num_blocks == 40
    assert any("--kv-cache-space asks for 4.00 GiB" in r.getMessage() for r in caplog.records)
    # too little for one sequence of max_model_len: a clear error at start naming the length that fits
    monkeypatch.setattr(host_memory, "available_bytes", lambda: GiB // 2 + 5 * bpb)
    with pytest.raises(ConfigError, match=r"maximum model length is 128 tokens.*lower --max-model-len to 80"):
        LLM(model=str(llama_dir), max_model_len=128, num_threads=1)
