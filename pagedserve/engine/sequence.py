"""Sequences and requests: the engine's per-request state, free of torch."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    max_tokens: int | None = None  # what the request asked (for the request_params_* metrics)
    n: int = 1


class Sequence:
    """One generated continuation. `token_ids` holds prompt + output; the KV of the first
    `num_computed_tokens` of them is in the blocks of `block_table`."""

    __slots__ = (
        "seq_id", "request", "index", "token_ids", "prompt_len", "status", "num_computed_tokens",
        "block_table", "num_hashed_blocks", "last_block_key", "generator", "logprobs",
        "cumulative_logprob", "finish_reason", "stop_reason", "detok", "spec_token_ids", "spec",
        "matcher",
    )

    def __init__(self, request: "Request", index: int, prompt_token_ids: list[int]):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # prefix caching: how many leading full blocks carry a hash
        self.last_block_key = None  # the hash key of block num_hashed_blocks-1 (chain parent)
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.logprobs: list | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.detok = None  # engine.detokenizer.IncrementalDetokenizer
        self.matcher = None  # llguidance.LLMatcher when the request has structured outputs
        self.spec_token_ids: list[int] = []  # draft tokens to verify after the next token (spec/)
        self.spec = None  # the speculative decoder's per-sequence state (spec/decoder.py)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recomputation: the KV is dropped; prompt + output so far is prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.last_block_key = None
        self.spec_token_ids = []
        self.status = SequenceStatus.WAITING


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None  # filled while the prompt is computed, if asked
    stop_token_ids: frozenset = frozenset()  # params.stop_token_ids plus EOS unless ignore_eos

    def __post_init__(self):
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids),
                                      max_tokens=self.params.max_tokens, n=self.params.n)
        self.seqs = [Sequence(self, i, self.prompt_token_ids) for i in range(self.params.n)]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM's shape)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
