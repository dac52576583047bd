"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out."""
from __future__ import annotations

import logging
import time

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.profiler import NULL_PHASE, StepProfiler
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.sequence import Request, Sequence, SequenceStatus
from pagedserve.engine.stats import EngineStats
from pagedserve.errors import InvalidRequestError
from pagedserve.runner.kv_cache import GiB, bytes_per_block, check_fits
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams
from pagedserve.validation import RequestValidator

log = logging.getLogger("pagedserve")


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate_static()
        self.config = config
        self.device = _resolve_device(config.device)
        runner_cls = ModelRunner.for_device(self.device)  # the one place the device path is decided
        runner_cls.prepare_process(config)
        torch.manual_seed(config.seed)
        if config.model is None:
            from pagedserve.default_model import default_model_path

            config.model = str(default_model_path())
        from pagedserve.model.loader import load_model

        t0 = time.time()
        loaded = load_model(config.model, dtype=config.dtype, device=self.device, max_positions=config.max_model_len,
                            tokenizer=config.tokenizer, revision=config.revision, quantization=config.quantization)
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        config.resolve(model_max_len=self.spec.max_position_embeddings, sliding_window=self.spec.sliding_window)
        self.quantization = loaded.quantization
        self.weight_bytes = self._log_weights(loaded)  # before prepacking, which keeps weights outside parameters
        self.runner = runner_cls(loaded.model, config, self.device)
        self.dtype = self.runner.dtype
        if config.served_model_name is None:
            config.served_model_name = config.model
        self.validator = RequestValidator.for_engine(config, self.spec.vocab_size, self.tokenizer,
                                                     loaded.generation_eos_ids)
        num_blocks = self.runner.num_kv_blocks()
        check_fits(config, num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = self.runner.kv
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.spec_decoder = None  # speculative decoding (spec/decoder.py), when configured
        if config.speculative_config is not None:
            from pagedserve.spec.decoder import build_decoder

            self.spec_decoder = build_decoder(config.speculative_config, self)
        self.requests: dict[str, Request] = {}
        self.structured = None  # structured/grammar.py GrammarCompiler, made by the first constrained request
        self.profiler: StepProfiler | None = None  # set to a StepProfiler to time each phase
        self._step_prompt_tokens = 0
        self._step_generation_tokens = 0
        tokens = num_blocks * config.block_size
        log.info(
            "loaded %s (%s, %s) on %s in %.1fs; attention: %s; KV cache: %d blocks x %d tokens = %d tokens "
            "(%.2f GiB), %.1f sequences of max_model_len=%d fit",
            config.model, self.spec.architecture, str(self.dtype).replace("torch.", ""), self.device, time.time() - t0,
            self.runner.backend.name, num_blocks, config.block_size, tokens,
            num_blocks * bytes_per_block(self.spec, config.block_size, self.dtype) / GiB,
            tokens / config.max_model_len, config.max_model_len,
        )

    @staticmethod
    def _log_weights(loaded) -> int:
        from pagedserve.quant.builder import weight_bytes

        total, quantized, layers = weight_bytes(loaded.model)
        if loaded.quantization is None or loaded.quantization.dense:
            what = "dense" if loaded.quantization is None else loaded.quantization.describe()
            log.info("weights: %.1f MB (%s)", total / 1e6, what)
        else:
            log.info("weights: %.1f MB, of which %.1f MB in %d %s-quantized modules", total / 1e6,
                     quantized / 1e6, layers, loaded.quantization.name)
        return total

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        """Queue a request; InvalidRequestError (pagedserve/validation.py) if it cannot be served as given."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if prompt_token_ids is None:
            self.validator.check_prompt_text(prompt)
            prompt_token_ids = self.tokenizer.encode(prompt)
        checked = self.validator.validate(prompt_token_ids, params)
        # (the pool holds at least one max_model_len sequence: check_fits at start-up)
        params.resolve_bad_words(self.tokenizer)
        matchers = self._matchers(params)  # compiles (or finds) the constraint: a bad one fails here
        req = Request(request_id, prompt, checked.prompt_token_ids, params,
                      arrival_time=arrival_time if arrival_time is not None else time.time(),
                      stop_token_ids=checked.stop_token_ids)
        for seq, matcher in zip(req.seqs, matchers):
            seq.matcher = matcher
            if params.detokenize:
                seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                   params.include_stop_str_in_output, params.skip_special_tokens)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def _matchers(self, params: SamplingParams) -> list:
        """One grammar matcher per sequence of a request with structured outputs, else Nones."""
        if params.structured_outputs is None:
            return [None] * params.n
        if self.structured is None:
            from pagedserve.structured.grammar import GrammarCompiler

            self.structured = GrammarCompiler(self.tokenizer, self.spec.vocab_size, lambda: self.validator.eos_ids)
        first = self.structured.matcher(params.structured_outputs)
        return [first] + [first.deep_copy() for _ in range(params.n - 1)]

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end generation unless a request sets ignore_eos (held by the validator)."""
        return sorted(self.validator.eos_ids)

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.validator.eos_ids = frozenset(ids)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- stepping ---------------------------------------------------------------------------
    def _phase(self, name: str):
        return self.profiler.phase(name) if self.profiler is not None else NULL_PHASE

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that got new tokens, or with
        finished_only (offline batch use) only for those that finished: building a streaming
        snapshot of each running request costs ~4 ms per 256-sequence step."""
        if self.spec_decoder is not None:
            with self._phase("propose"):
                self.spec_decoder.propose(self.scheduler.running)
        with self._phase("schedule"):
            sched = self.scheduler.schedule()
        self._step_prompt_tokens = self._step_generation_tokens = 0
        if sched.is_empty:
            return []
        if self.profiler is not None:
            self.profiler.steps += 1
            self.profiler.seqs += len(sched.scheduled)
        now = time.time()
        for e in sched.scheduled:
            m = e.seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.runner.execute(sched, self._phase)
        with self._phase("postprocess"):
            return self._process_result(sched, result, finished_only)

    def _process_result(self, sched, result, finished_only: bool = False) -> list[RequestOutput]:
        for e in sched.scheduled:
            seq = e.seq
            seq.num_computed_tokens = e.start + e.num_new_tokens - e.num_spec_tokens
            if (e.num_new_tokens > 1 and not e.num_spec_tokens) or e.start < seq.prompt_len:
                self._step_prompt_tokens += e.num_new_tokens
        for e, entries in result.prompt_logprobs:
            req = e.seq.request
            req.prompt_logprobs.extend(self._logprob_dict(t) for t in entries)
        touched: dict[str, Request] = {}
        now = time.time()
        for e, tok in result.sampled:
            seq = e.seq
            self._append_token(seq, tok, now)
            touched[seq.request.request_id] = seq.request
        self._step_generation_tokens = len(result.sampled)
        for e, verdict in result.verified:
            self._step_generation_tokens += self._append_verified(e.seq, verdict, now)
            touched[e.seq.request.request_id] = e.seq.request
        outputs = [self._make_output(req) for req in touched.values() if req.finished or not finished_only]
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _append_verified(self, seq: Sequence, verdict, now: float) -> int:
        """Append a verified run (accepted drafts, then the target's token) until the sequence stops;
        the KV of rejected drafts is dropped (computed count and blocks rolled back)."""
        n = seq.num_tokens
        appended = 0
        for tok in verdict.tokens:
            self._append_token(seq, tok, now)
            appended += 1
            if seq.finished:
                break
        seq.spec_token_ids = []
        if not seq.finished:
            seq.num_computed_tokens = n + verdict.num_accepted  # the accepted drafts' KV is the tokens' KV
            self.block_manager.trim(seq, seq.num_tokens)
        self.spec_decoder.on_verified(seq, verdict)
        return appended

    def _append_token(self, seq: Sequence, tok, now: float) -> None:
        p = seq.params
        seq.token_ids.append(tok.token_id)
        m = seq.request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generation_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_dict(tok))
            seq.cumulative_logprob += tok.logprob
        n_out = seq.num_output_tokens
        if seq.matcher is not None and not seq.matcher.consume_token(tok.token_id):
            # only when other logit edits (allowed_token_ids, logit_bias) left no token the grammar allows
            log.warning("request %s: token %d breaks its structured-output constraint (%s); stopping it",
                        seq.request.request_id, tok.token_id, seq.matcher.get_error())
            self._finish(seq, "length")
            return
        if tok.token_id in seq.request.stop_token_ids and n_out >= p.min_tokens:
            seq.stop_reason = tok.token_id if tok.token_id in p.stop_token_ids else None
            # the stop token's text is not part of the output unless asked for (as in vLLM)
            self._finish(seq, "stop", text_upto=None if p.include_stop_str_in_output else -1)
            return
        if seq.detok is not None:
            # stop strings count from the token after the min_tokens-th one (vLLM's rule): text
            # produced up to min_tokens is never searched
            seq.detok.add_tokens(seq.token_ids, check_stop=n_out > p.min_tokens)
            if seq.detok.stopped_on is not None:
                seq.stop_reason = seq.detok.stopped_on
                self._finish(seq, "stop")
                return
        if seq.matcher is not None and seq.matcher.is_stopped():
            self._finish(seq, "stop")  # the constraint is complete: nothing but EOS could follow
            return
        if n_out >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, text_upto: int | None = None) -> None:
        """text_upto=-1: the last token (a stop token) adds no text."""
        if seq.status is not SequenceStatus.FINISHED:
            if self.spec_decoder is not None:
                self.spec_decoder.release(seq)
            if reason != "abort":
                self.scheduler.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            if seq.detok is not None and reason != "abort":
                seq.detok.flush(seq.token_ids[:text_upto] if text_upto is not None else seq.token_ids)
            m = seq.request.metrics
            m.finished_time = time.time()

    def _logprob_dict(self, tok) -> dict[int, Logprob]:
        dec = self.tokenizer.decode
        d = {tok.token_id: Logprob(tok.logprob, tok.rank, dec([tok.token_id]))}
        for i, (tid, lp) in enumerate(tok.top or []):
            if tid not in d:
                d[tid] = Logprob(lp, i + 1, dec([tid]))
        return d

    def _make_output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            text = seq.detok.visible_text(seq.finished) if seq.detok is not None else ""
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                             list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                             outs, req.finished, req.metrics, num_cached_tokens=req.metrics.num_cached_tokens or 0)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        sch = self.scheduler
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting), kv_cache_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_preemptions_total=sch.num_preemptions, prefix_cache_queries=bm.query_tokens,
            prefix_cache_hits=bm.hit_tokens, step_prompt_tokens=self._step_prompt_tokens,
            step_generation_tokens=self._step_generation_tokens,
            num_waiting_tokens=sum(s.num_tokens for s in sch.waiting),
            spec_decode=self.spec_decoder.stats.snapshot() if self.spec_decoder is not None else None,
        )
