"""Front-end side of the engine-core process: turns the core's per-step deltas back into the
cumulative RequestOutputs callers see (engine/outputs.py), detokenizing here, out of the engine's
way.

Stop strings are checked here too, token by token exactly as LLMEngine does, when the request has
one choice: the choice ends at the token that completed the stop string and the caller aborts the
request in the core (which may have run a step or two past it: wasted work, never wrong output).
A request with several choices and stop strings is detokenized in the core, because one choice's
stop must not end its siblings; its text arrives as deltas.
"""
from __future__ import annotations

import copy
import dataclasses
import time

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.outputs import CompletionOutput, RequestOutput


def detokenize_in_front_end(params) -> bool:
    return bool(params.detokenize) and not (params.stop and params.n > 1)


def params_for_core(params):
    """The SamplingParams the core runs: without detokenization or stop strings when the front end
    does both."""
    if not detokenize_in_front_end(params):
        return params
    return dataclasses.replace(params, detokenize=False, stop=[])


class _Choice:
    __slots__ = ("ids", "all_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "detok", "text")

    def __init__(self, prompt_ids: list[int], params, tokenizer, detok: bool):
        self.ids: list[int] = []
        self.all_ids = list(prompt_ids) if detok else None
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason = None
        self.stop_reason = None
        self.text = ""
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                             params.skip_special_tokens) if detok else None)


class _Request:
    __slots__ = ("prompt", "prompt_ids", "params", "choices", "prompt_logprobs", "metrics", "num_cached_tokens")

    def __init__(self, prompt, prompt_ids, params, tokenizer):
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        detok = detokenize_in_front_end(params)
        self.choices = [_Choice(self.prompt_ids, params, tokenizer, detok) for _ in range(params.n)]
        self.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        self.metrics = None
        self.num_cached_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt, prompt_ids: list[int], params) -> None:
        self.requests[request_id] = _Request(prompt, prompt_ids, params, self.tokenizer)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def clear(self) -> None:
        self.requests.clear()

    def process(self, delta) -> tuple[RequestOutput | None, bool]:
        """Apply one RequestDelta; returns (the cumulative output, whether a stop string ended the
        request here, so the core must be told to abort it)."""
        rid, core_finished, seqs, plp, metrics, num_cached = delta
        req = self.requests.get(rid)
        if req is None:
            return None, False
        if metrics is not None:
            req.metrics = metrics
        req.num_cached_tokens = num_cached
        if plp is not None and req.prompt_logprobs is not None:
            req.prompt_logprobs.extend(plp)
        stopped_here = False
        for index, new_ids, new_lps, cum_lp, fin, stop_reason, text in seqs:
            c = req.choices[index]
            if c.finish_reason is not None:
                continue  # ended here by a stop string; the core has not heard yet
            if c.detok is None:
                c.ids.extend(new_ids)
                if new_lps is not None and c.logprobs is not None:
                    c.logprobs.extend(new_lps)
                c.cumulative_logprob = cum_lp
                if text:
                    c.text += text
            elif self._detokenize(req, c, new_ids, new_lps, fin):
                stopped_here = True
                continue
            if fin is not None:
                c.finish_reason, c.stop_reason = fin, stop_reason
                if c.detok is not None and fin != "abort":
                    # a stop token's text is not output unless asked for (LLMEngine._append_token)
                    token_stop = fin == "stop" and not req.params.include_stop_str_in_output
                    c.detok.flush(c.all_ids[:-1] if token_stop else c.all_ids)
        finished = all(c.finish_reason is not None for c in req.choices)
        if finished and not core_finished:
            stopped_here = True
            self._end_metrics(req)
        out = self._output(rid, req, finished)
        if finished:
            del self.requests[rid]
        return out, stopped_here and finished

    def _detokenize(self, req: _Request, c: _Choice, new_ids, new_lps, fin) -> bool:
        """Append tokens one by one as LLMEngine does; True if a stop string ended the choice."""
        params = req.params
        for k, tok in enumerate(new_ids):
            c.ids.append(tok)
            c.all_ids.append(tok)
            if c.logprobs is not None and new_lps is not None:
                lp = new_lps[k]
                c.logprobs.append(lp)
                chosen = lp.get(tok) if isinstance(lp, dict) else None
                if chosen is not None:
                    c.cumulative_logprob += chosen.logprob
            if fin == "stop" and k == len(new_ids) - 1:
                break  # a stop token: the engine checks it before detokenizing (flushed below)
            # stop strings count from the token after the min_tokens-th one, as in LLMEngine
            c.detok.add_tokens(c.all_ids, check_stop=len(c.ids) > params.min_tokens)
            if c.detok.stopped_on is not None:
                c.finish_reason, c.stop_reason = "stop", c.detok.stopped_on
                return True
        return False

    @staticmethod
    def _end_metrics(req: _Request) -> None:
        now = time.time()
        m = copy.copy(req.metrics) if req.metrics is not None else None
        if m is not None:
            m.last_token_time = m.finished_time = now
            m.num_generation_tokens = sum(len(c.ids) for c in req.choices)
        req.metrics = m

    @staticmethod
    def _output(rid: str, req: _Request, finished: bool) -> RequestOutput:
        outs = []
        for i, c in enumerate(req.choices):
            text = c.detok.visible_text(c.finish_reason is not None) if c.detok is not None else c.text
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(c.ids),
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        plp = list(req.prompt_logprobs) if req.prompt_logprobs is not None else None
        return RequestOutput(rid, req.prompt, req.prompt_ids, plp, outs, finished, req.metrics,
                             num_cached_tokens=req.num_cached_tokens)
