"""Perplexity of a model over a text file, computed by pagedserve's own model code.

What is scored, exactly
-----------------------
1. The whole file is read as UTF-8 and tokenized once with the model's tokenizer and its default
   special tokens (`tokenizer.encode(text)`: for Llama-style tokenizers that puts one BOS at the very
   start of the file, and nowhere else).
2. The token ids are cut into windows: window k covers ids[k*stride : k*stride + window] (the last
   one is shorter if the file ends first); no window starts after the one that reaches the end.
3. Each window is run through the engine on its own, from an empty context (a fresh sequence:
   no KV from earlier windows), as a prompt with `SamplingParams(max_tokens=1, prompt_logprobs=0)`.
   The engine's prompt logprobs hold log p(ids[i] | window's ids before i) for i = 1..len-1.
4. Scored tokens: in the first window, window positions 1..len-1. In every later window, only the
   positions whose absolute index is at or past the end of the previous window, so each token of
   the file is scored at most once, with as much context as its window gives it. With stride ==
   window (the default) that is again positions 1..len-1 of every window: the first token of each
   window is context only and is never scored.
5. perplexity = exp(mean over all scored tokens of -log p).

The result equals what transformers gives for `model(window_ids)` with the same windows and the
same scored positions (tests/test_eval_perplexity.py checks that).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

DEFAULT_WINDOW = 512


@dataclass
class Window:
    start: int  # absolute index of the window's first token in the file's token ids
    end: int  # exclusive
    first_scored: int  # absolute index of the first scored token (>= start + 1)


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_scored_tokens: int
    num_tokens: int  # tokens in the whole file
    num_windows: int
    window: int
    stride: int
    model: str
    dtype: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"perplexity {self.perplexity:.4f} (mean NLL {self.mean_nll:.4f} nats) over "
                f"{self.num_scored_tokens} scored tokens of {self.num_tokens}, {self.num_windows} window(s) of "
                f"{self.window} tokens, stride {self.stride}; {self.model} ({self.dtype}) in {self.seconds:.1f}s")


def make_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows over num_tokens ids (see the module docstring); windows that score nothing are dropped."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if stride < 1 or stride > window:
        raise ValueError(f"stride must be between 1 and the window ({window}), got {stride}")
    out: list[Window] = []
    prev_end = 0
    start = 0
    while start < num_tokens:
        end = min(start + window, num_tokens)
        first = max(start + 1, prev_end)
        if first < end:
            out.append(Window(start, end, first))
        prev_end = end
        if end == num_tokens:
            break
        start += stride
    return out


def window_nlls(llm, token_ids: list[int], windows: list[Window]) -> list[list[float]]:
    """-log p of every scored token, per window, from the engine's prompt logprobs (all windows in one batch)."""
    from pagedserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": token_ids[w.start:w.end]} for w in windows]
    outs = llm.generate(prompts, sp)
    result = []
    for w, out in zip(windows, outs):
        ids = out.prompt_token_ids
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(ids):
            raise RuntimeError(f"the engine returned {0 if plp is None else len(plp)} prompt logprobs for "
                               f"a {len(ids)}-token window")
        result.append([-plp[i][ids[i]].logprob for i in range(w.first_scored - w.start, w.end - w.start)])
    return result


def perplexity_of_ids(llm, token_ids: list[int], window: int, stride: int) -> tuple[float, float, int, int]:
    """(perplexity, mean NLL, scored tokens, windows) of token_ids under llm's model."""
    windows = make_windows(len(token_ids), window, stride)
    if not windows:
        raise ValueError(f"the text has {len(token_ids)} token(s); at least 2 are needed to score one")
    nlls = [x for per in window_nlls(llm, token_ids, windows) for x in per]
    mean = math.fsum(nlls) / len(nlls)
    return math.exp(mean), mean, len(nlls), len(windows)


def encode_text(tokenizer, text: str) -> list[int]:
    """The file's token ids: one encode of the whole text with the tokenizer's default special tokens."""
    try:
        return list(tokenizer.encode(text, verbose=False))  # no "longer than the maximum length" warning
    except TypeError:
        return list(tokenizer.encode(text))


def max_window(llm) -> int:
    """Longest window the engine takes: a prompt of n tokens plus the 1 generated token must fit max_model_len."""
    return llm.llm_engine.config.max_model_len - 1


def evaluate(llm, text: str, window: int | None = None, stride: int | None = None) -> PerplexityResult:
    """Perplexity of llm's model over text. window None: 512, or max_model_len - 1 if that is smaller;
    stride None: the window (disjoint windows)."""
    limit = max_window(llm)
    if window is None:
        window = min(DEFAULT_WINDOW, limit)
    elif window > limit:
        raise ValueError(f"window {window} is longer than this engine takes (max_model_len - 1 = {limit}); "
                         f"use --window {limit} or less, or raise --max-model-len")
    stride = window if stride is None else stride
    t0 = time.time()
    ids = encode_text(llm.get_tokenizer(), text)
    ppl, mean, n_scored, n_windows = perplexity_of_ids(llm, ids, window, stride)
    cfg = llm.llm_engine.config
    return PerplexityResult(perplexity=ppl, mean_nll=mean, num_scored_tokens=n_scored, num_tokens=len(ids),
                            num_windows=n_windows, window=window, stride=stride, model=str(cfg.model),
                            dtype=str(llm.llm_engine.dtype).replace("torch.", ""), seconds=time.time() - t0)
