"""What every engine front end shares, wherever the engine runs (a thread: AsyncEngine; another
process: EngineCoreClient): the per-request streams, admission control, abort bookkeeping,
handing outputs to streams and metrics observers, the graceful drain, the periodic stats line.

A subclass supplies the transport: `_submit_add` (queue an add, return a future resolved when
the engine accepted or refused it), `_send_abort`, `_engine_alive`, `_num_pending_adds`,
`_stop_engine`, and `_push_to` (how an item reaches a stream from the thread that has it).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from pagedserve.engine.request_stream import (
    _ABORTED,
    EngineDeadError,
    EngineObserver,
    EngineShuttingDownError,
    QueueFullError,
    RequestStream,
)
from pagedserve.errors import InvalidRequestError

logger = logging.getLogger("pagedserve.engine")


class EngineFrontend:
    def __init__(
        self,
        *,
        observer: EngineObserver | None = None,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        log_requests: bool = True,
        log_stats: bool = True,
        stats_log_interval: float = 10.0,
    ):
        self.observer = observer or EngineObserver()
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.log_requests = log_requests
        self.log_stats = log_stats
        self.stats_log_interval = stats_log_interval
        self._accepting = True
        self._streams_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._queued_tokens = 0  # prompt tokens of requests that have not been scheduled yet
        # requests accepted but without a first output yet: counted here, at once, because the
        # engine's stats snapshot lags a step behind and a burst would slip past the limit
        self._queued_reqs = 0
        self._stats = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop requests come from
        # called on that loop with a reason when the engine is gone for good (the server exits)
        self.on_fatal = None
        # periodic log accumulators (whichever thread sees the engine's stats first)
        self._log_t = time.monotonic()
        self._log_prompt = 0
        self._log_gen = 0
        self._log_q = 0
        self._log_h = 0
        self._log_spec = None

    def _init_stats(self, stats) -> None:
        self._stats = stats
        self._log_q = getattr(stats, "prefix_cache_queries", 0) or 0
        self._log_h = getattr(stats, "prefix_cache_hits", 0) or 0
        self._log_spec = getattr(stats, "spec_decode", None)

    # ------------------------------------------------------------------ transport (subclasses)
    def _engine_alive(self) -> bool:
        raise NotImplementedError

    def _num_pending_adds(self) -> int:
        raise NotImplementedError

    def _submit_add(self, request_id: str, stream: RequestStream, kwargs: dict) -> asyncio.Future:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _push_to(self, stream: RequestStream, item) -> None:
        raise NotImplementedError

    async def _stop_engine(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start serving (idempotent)."""

    # ------------------------------------------------------------------ state
    def is_alive(self) -> bool:
        return self._engine_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stats(self):
        """The engine's stats as of the end of the last step (never blocks on a running step)."""
        return self._stats

    def num_in_flight(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    # ------------------------------------------------------------------ admission
    def check_admission(self, num_requests: int = 1, num_prompt_tokens: int = 0) -> None:
        """Raise unless `num_requests` new requests with that many prompt tokens may queue now."""
        if not self._engine_alive():
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        if self.max_num_queued_reqs is not None:
            with self._streams_lock:
                waiting = self._queued_reqs
            if waiting + num_requests > self.max_num_queued_reqs:
                raise QueueFullError(
                    f"the server is overloaded: {waiting} requests are already waiting "
                    f"(--max-num-queued-reqs {self.max_num_queued_reqs}); retry later",
                    reason="queued_reqs",
                )
        if self.max_num_queued_tokens is not None:
            if num_prompt_tokens > self.max_num_queued_tokens:
                raise InvalidRequestError(
                    f"the prompt has {num_prompt_tokens} tokens, more than this server queues at once "
                    f"(--max-num-queued-tokens {self.max_num_queued_tokens})",
                    "prompt",
                )
            with self._streams_lock:
                queued = self._queued_tokens
            if queued + num_prompt_tokens > self.max_num_queued_tokens:
                raise QueueFullError(
                    f"the server is overloaded: {queued} prompt tokens are already waiting "
                    f"(--max-num-queued-tokens {self.max_num_queued_tokens}); retry later",
                    reason="queued_tokens",
                )

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params=None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        *,
        check_admission: bool = True,
    ) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it.

        Raises InvalidRequestError (bad input), QueueFullError, EngineShuttingDownError,
        EngineDeadError. If the caller is cancelled while waiting, the request is aborted.
        """
        n_prompt = len(prompt_token_ids) if prompt_token_ids is not None else 0
        if check_admission:
            self.check_admission(1, n_prompt)
        fut, stream = self._enqueue(request_id, prompt, params, prompt_token_ids, arrival_time)
        return await self._accepted(request_id, fut, stream, params)

    async def add_requests(self, requests: list[tuple], arrival_time: float | None = None) -> list[RequestStream]:
        """Queue (request_id, prompt, params, prompt_token_ids) tuples all or none, after one admission
        check for the whole batch. The check and the queueing happen without yielding to the event
        loop, so a burst of concurrent callers cannot all pass the check before any of them counts."""
        self.check_admission(len(requests), sum(len(r[3] or ()) for r in requests))
        pending = []
        try:
            for rid, prompt, params, ids in requests:
                pending.append((rid, *self._enqueue(rid, prompt, params, ids, arrival_time), params))
        except BaseException:
            for rid, *_ in pending:
                self.abort(rid)
            raise
        results = await asyncio.gather(*(self._accepted(*p) for p in pending), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid, *_ in pending:
                self.abort(rid)
            raise next((e for e in errors if isinstance(e, asyncio.CancelledError)), errors[0])
        return results

    def _enqueue(self, request_id, prompt, params, prompt_token_ids, arrival_time):
        """Register the stream and hand the add to the engine (synchronous: no await)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        arrival_time = time.time() if arrival_time is None else arrival_time
        n_prompt = len(prompt_token_ids) if prompt_token_ids is not None else 0
        if not self._engine_alive():
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        self.start()
        stream = RequestStream(request_id, loop, n_prompt, arrival_time)
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = stream
            self._queued_tokens += n_prompt
            self._queued_reqs += 1
        kwargs = dict(prompt=prompt, params=params, prompt_token_ids=prompt_token_ids, arrival_time=arrival_time)
        return self._submit_add(request_id, stream, kwargs), stream

    async def _accepted(self, request_id, fut, stream, params) -> RequestStream:
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        if self.log_requests:
            logger.info("Added request %s: %d prompt tokens, params=%s", request_id, stream.num_prompt_tokens, params)
        return stream

    async def generate(self, request_id: str, prompt=None, params=None, prompt_token_ids=None):
        """Convenience: add a request and yield its outputs; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, shutdown). Its KV blocks are freed at the next step
        boundary, at once if the engine is idle. Unknown or finished ids are ignored."""
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            stream.aborted = True
            if not stream.dequeued:
                stream.dequeued = True
                self._queued_tokens -= stream.num_prompt_tokens
                self._queued_reqs -= 1
        self._send_abort(request_id)
        self._call_observer("on_request_aborted", stream, time.time())
        stream._push(_ABORTED)
        if self.log_requests:
            logger.info("Aborted request %s", request_id)

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and not stream.dequeued:
                stream.dequeued = True
                self._queued_tokens -= stream.num_prompt_tokens
                self._queued_reqs -= 1

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _report_fatal(self, reason: str) -> None:
        cb = self.on_fatal
        if cb is None:
            return
        loop = self._loop
        if loop is None:
            cb(reason)
        else:
            try:
                loop.call_soon_threadsafe(cb, reason)
            except RuntimeError:  # the loop is closed: nobody to tell
                pass

    def _fail_all(self, err: BaseException) -> None:
        """The engine is gone: every open stream ends with `err`."""
        with self._streams_lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._queued_tokens = 0
            self._queued_reqs = 0
        for s in streams:
            self._push_to(s, err)

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish within `timeout` s; abort the rest; stop."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, timeout)
        while self.num_in_flight() and time.monotonic() < deadline and self._engine_alive():
            await asyncio.sleep(0.05)
        with self._streams_lock:
            left = list(self._streams)
        if left:
            logger.info("Shutdown: aborting %d unfinished request(s)", len(left))
        for rid in left:
            self.abort(rid)
        await self._stop_engine()

    # ------------------------------------------------------------------ outputs
    def _call_observer(self, name: str, *a) -> None:
        try:
            getattr(self.observer, name)(*a)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.exception("metrics observer %s failed", name)

    def _on_step_stats(self, stats, step_seconds: float | None) -> None:
        """A new stats snapshot from the engine (after a step when step_seconds is set)."""
        self._stats = stats
        if step_seconds is not None:
            self._call_observer("on_step", stats, step_seconds)
            self._log_prompt += getattr(stats, "step_prompt_tokens", 0) or 0
            self._log_gen += getattr(stats, "step_generation_tokens", 0) or 0
        if self.log_stats:
            self._maybe_log(stats)

    def _dispatch(self, outputs: list) -> None:
        """Hand cumulative RequestOutputs to their streams, feeding the observer on the way."""
        now = time.time()
        for out in outputs:
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
                if stream is None or stream.aborted:
                    continue
                if not stream.dequeued:
                    stream.dequeued = True
                    self._queued_tokens -= stream.num_prompt_tokens
                    self._queued_reqs -= 1
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    stream.finished = True
            total = sum(len(o.token_ids) for o in out.outputs)
            new = total - stream.tokens_seen
            if new > 0:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                self._call_observer("on_request_output", stream, out, new, now)
                stream.tokens_seen = total
                stream.last_token_time = now
            if out.finished:
                self._call_observer("on_request_finished", stream, out, now)
                if self.log_requests:
                    reasons = ",".join(str(o.finish_reason) for o in out.outputs)
                    logger.info("Finished request %s: %d generated tokens, finish_reason=%s",
                                out.request_id, total, reasons)
            self._push_to(stream, out)

    def _maybe_log(self, stats) -> None:
        now = time.monotonic()
        dt = now - self._log_t
        if dt < self.stats_log_interval:
            return
        if not (self._log_prompt or self._log_gen or getattr(stats, "num_running", 0)
                or getattr(stats, "num_waiting", 0)):
            self._log_t = now
            return
        q = getattr(stats, "prefix_cache_queries", 0) or 0
        h = getattr(stats, "prefix_cache_hits", 0) or 0
        dq, dh = q - self._log_q, h - self._log_h
        hit = (100.0 * dh / dq) if dq > 0 else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self._log_prompt / dt, self._log_gen / dt,
            getattr(stats, "num_running", 0), getattr(stats, "num_waiting", 0),
            100.0 * (getattr(stats, "kv_cache_usage", 0.0) or 0.0), hit,
        )
        sd = getattr(stats, "spec_decode", None)
        if sd is not None:
            logger.info("%s", _spec_log_line(sd, self._log_spec))
            self._log_spec = sd
        self._log_t = now
        self._log_prompt = self._log_gen = 0
        self._log_q, self._log_h = q, h


def _spec_log_line(now, before) -> str:
    """Speculative decoding over the last log interval, as vLLM's SpecDecoding metrics line."""
    drafts = now.num_drafts - (before.num_drafts if before else 0)
    drafted = now.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = now.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    mean_len = 1.0 + accepted / drafts if drafts else 0.0
    rate = 100.0 * accepted / drafted if drafted else 0.0
    return (f"SpecDecoding metrics: Mean acceptance length: {mean_len:.2f}, Accepted: {accepted} tokens, "
            f"Drafted: {drafted} tokens, Draft acceptance rate: {rate:.1f}%")
