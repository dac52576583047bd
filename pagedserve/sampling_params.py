"""SamplingParams: what a request asks of the sampler, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.errors import InvalidRequestError

_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # filled by the engine
    _all_stop_token_ids: set = field(default_factory=set, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def validate(self, max_logprobs: int = 20) -> None:
        def bad(msg, param):
            raise InvalidRequestError(msg, param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.", "n")
        import math

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}.", name)
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            bad(f"seed must fit in a signed 64-bit integer, got {self.seed}.", "seed")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}.", "top_k")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if not (0.0 < self.repetition_penalty <= 2.0):
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.", "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (v < 0 or v > max_logprobs):
                bad(f"{name} must be between 0 and {max_logprobs}, got {v}.", name)
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty.", "stop")
