"""AsyncEngine: LLMEngine driven by one background thread, consumed from asyncio.

Threading model
---------------
* ONE dedicated engine thread makes every LLMEngine call (add_request, abort_request, step, stats),
  each under `self._lock`. torch releases the GIL during compute, so the asyncio loop (HTTP
  parsing, SSE writing) stays responsive while a step runs.
* The asyncio side never blocks on the engine: it appends commands (add / abort) to a FIFO and
  wakes the thread through a Condition; the thread applies them between two steps, in order, so
  an abort can never overtake the add it cancels. With no work the thread sleeps on the
  Condition (no busy spin).
* Results travel back with `loop.call_soon_threadsafe` into a per-request stream (a deque + an
  asyncio.Event). RequestOutput fields are cumulative, so a slow consumer only ever needs the
  latest one: the stream coalesces.
* `add_request` is a coroutine that returns once the engine accepted the request; an
  InvalidRequestError from LLMEngine.add_request (or from the cheap checks done before queueing)
  propagates to the caller (HTTP 400) before anything has been streamed.
* `abort(request_id)` is synchronous and non-blocking; the engine thread frees the request's KV
  blocks at the next step boundary (immediately when idle).
* `stats()` returns the snapshot the engine thread takes after every step / command batch, so
  a /metrics scrape never waits for a step.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from pagedserve.engine.request_stream import (
    _ABORTED,
    EngineDeadError,
    EngineObserver,
    EngineShuttingDownError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from pagedserve.errors import InvalidRequestError

logger = logging.getLogger("pagedserve.engine")


class _Cmd:
    __slots__ = ("kind", "stream", "kwargs", "future", "request_id")

    def __init__(self, kind, request_id, stream=None, kwargs=None, future=None):
        self.kind = kind
        self.request_id = request_id
        self.stream = stream
        self.kwargs = kwargs
        self.future = future


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(True)
    else:
        fut.set_exception(exc)


class AsyncEngine:
    def __init__(
        self,
        engine,
        *,
        observer: EngineObserver | None = None,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        log_requests: bool = True,
        log_stats: bool = True,
        stats_log_interval: float = 10.0,
    ):
        self.engine = engine
        self.observer = observer or EngineObserver()
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.log_requests = log_requests
        self.log_stats = log_stats
        self.stats_log_interval = stats_log_interval

        self._lock = threading.RLock()  # around every LLMEngine call
        self._cv = threading.Condition()  # guards _cmds / _stopping / _has_work; wakes the thread
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self._num_pending_adds = 0
        self._has_work = False
        self._stopping = False
        self._accepting = True
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None

        self._streams_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._queued_tokens = 0  # prompt tokens of requests that have not been scheduled yet

        with self._lock:
            self._stats = engine.stats()
        # periodic log accumulators (engine thread)
        self._log_t = time.monotonic()
        self._log_prompt = 0
        self._log_gen = 0
        self._log_q = getattr(self._stats, "prefix_cache_queries", 0) or 0
        self._log_h = getattr(self._stats, "prefix_cache_hits", 0) or 0
        self._log_spec = getattr(self._stats, "spec_decode", None)

    # ------------------------------------------------------------------ construction / lifecycle
    @classmethod
    def from_config(cls, config, **kw) -> "AsyncEngine":
        from pagedserve.engine.engine import LLMEngine

        return cls(LLMEngine(config), **kw)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

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
        if self._dead is not None or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        if self.max_num_queued_reqs is not None:
            with self._cv:
                pending = self._num_pending_adds
            waiting = (getattr(self._stats, "num_waiting", 0) or 0) + pending
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
        loop = asyncio.get_running_loop()
        arrival_time = time.time() if arrival_time is None else arrival_time
        n_prompt = len(prompt_token_ids) if prompt_token_ids is not None else 0
        if check_admission:
            self.check_admission(1, n_prompt)
        elif self._dead is not None:
            raise EngineDeadError("the engine is not running")
        elif not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        if self._thread is None:
            self.start()
        stream = RequestStream(request_id, loop, n_prompt, arrival_time)
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = stream
            self._queued_tokens += n_prompt
        fut = loop.create_future()
        kwargs = dict(prompt=prompt, params=params, prompt_token_ids=prompt_token_ids, arrival_time=arrival_time)
        with self._cv:
            self._cmds.append(_Cmd("add", request_id, stream, kwargs, fut))
            self._num_pending_adds += 1
            self._cv.notify()
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        if self.log_requests:
            logger.info("Added request %s: %d prompt tokens, params=%s", request_id, n_prompt, params)
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
        with self._cv:
            self._cmds.append(_Cmd("abort", request_id))
            self._cv.notify()
        try:
            self.observer.on_request_aborted(stream, time.time())
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.exception("metrics observer failed")
        stream._push(_ABORTED)
        if self.log_requests:
            logger.info("Aborted request %s", request_id)

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and not stream.dequeued:
                stream.dequeued = True
                self._queued_tokens -= stream.num_prompt_tokens

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish within `timeout` s; abort the rest; stop."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, timeout)
        while self.num_in_flight() and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        with self._streams_lock:
            left = list(self._streams)
        if left:
            logger.info("Shutdown: aborting %d unfinished request(s)", len(left))
        for rid in left:
            self.abort(rid)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10.0)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        logger.debug("engine thread started")
        try:
            while True:
                with self._cv:
                    while not self._cmds and not self._has_work and not self._stopping:
                        # Sleep until work arrives; wake once later to flush a pending stats line.
                        pending_log = self.log_stats and (self._log_prompt or self._log_gen)
                        if pending_log:
                            left = self.stats_log_interval - (time.monotonic() - self._log_t)
                            if left <= 0:
                                break
                            self._cv.wait(timeout=left)
                        else:
                            self._cv.wait()
                    cmds = list(self._cmds)
                    self._cmds.clear()
                    stopping = self._stopping
                if cmds:
                    self._apply(cmds)
                outputs: list = []
                step_s = None
                with self._lock:
                    if self.engine.has_unfinished_requests():
                        t0 = time.perf_counter()
                        outputs = self.engine.step()
                        step_s = time.perf_counter() - t0
                    has_work = self.engine.has_unfinished_requests()
                    stats = self.engine.stats()
                self._stats = stats
                with self._cv:
                    self._has_work = has_work
                if step_s is not None:
                    self._call_observer("on_step", stats, step_s)
                    self._log_prompt += getattr(stats, "step_prompt_tokens", 0) or 0
                    self._log_gen += getattr(stats, "step_generation_tokens", 0) or 0
                if outputs:
                    self._dispatch(outputs)
                if self.log_stats:
                    self._maybe_log(stats, force_idle=not has_work)
                if stopping and not has_work:
                    with self._cv:
                        if not self._cmds:
                            break
        except BaseException as e:  # noqa: BLE001 - report to every waiter, then die
            logger.exception("engine thread died")
            self._dead = e
            err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            with self._cv:
                cmds = list(self._cmds)
                self._cmds.clear()
                self._num_pending_adds = 0
            for c in cmds:
                if c.future is not None:
                    c.stream._loop.call_soon_threadsafe(_resolve, c.future, err)
            with self._streams_lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                s._push(err)
        logger.debug("engine thread stopped")

    def _call_observer(self, name: str, *a) -> None:
        try:
            getattr(self.observer, name)(*a)
        except Exception:  # noqa: BLE001
            logger.exception("metrics observer %s failed", name)

    def _apply(self, cmds: list[_Cmd]) -> None:
        with self._lock:
            for c in cmds:
                if c.kind == "add":
                    err = None
                    try:
                        self.engine.add_request(c.request_id, **c.kwargs)
                    except Exception as e:  # noqa: BLE001 - InvalidRequestError is the expected kind
                        err = e
                        if not isinstance(e, InvalidRequestError):
                            logger.exception("add_request(%s) failed", c.request_id)
                    with self._cv:
                        self._num_pending_adds -= 1
                    c.stream._loop.call_soon_threadsafe(_resolve, c.future, err)
                else:
                    self.engine.abort_request(c.request_id)

    def _dispatch(self, outputs: list) -> None:
        now = time.time()
        for out in outputs:
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
                if stream is None or stream.aborted:
                    continue
                if not stream.dequeued:
                    stream.dequeued = True
                    self._queued_tokens -= stream.num_prompt_tokens
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
            stream._push(out)

    def _maybe_log(self, stats, force_idle: bool = False) -> None:
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
