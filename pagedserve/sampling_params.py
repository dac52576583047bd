"""SamplingParams: what a request asks of the sampler, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.structured.params import StructuredOutputsParams

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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (each as one or more tokens)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    # filled by the engine (resolve_bad_words)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    @property
    def has_logits_processing(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler edits this row's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids)

    def resolve_bad_words(self, tokenizer) -> None:
        """Each bad word as token ids, alone and after a space (a word mid-sentence is usually
        tokenized with its leading space); the second form only when it really differs."""
        self._bad_words_token_ids = []
        for word in self.bad_words or []:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                continue
            self._bad_words_token_ids.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self._bad_words_token_ids.append(spaced)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def validate(self, max_logprobs: int = 20) -> None:
        """The checks that need no model (pagedserve/validation.py holds every rule)."""
        from pagedserve.validation import check_sampling_params

        check_sampling_params(self, max_logprobs)
