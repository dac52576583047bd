"""A snapshot of the engine's load, for metrics and logs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1 of the block pool in use
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions_total: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    step_prompt_tokens: int  # prompt tokens computed in the last step
    step_generation_tokens: int  # tokens generated in the last step
    num_waiting_tokens: int = 0  # prompt tokens of waiting requests (admission control)
    spec_decode: object = None  # speculative decoding's cumulative counters (spec/decoder.SpecStats), when on
