"""AsyncEngine: LLMEngine driven by one background thread of this process, consumed from asyncio
(`LLM`-style in-process serving; `pagedserve serve` runs the engine in its own process instead,
engine/core_client.py, unless --no-engine-process).

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
Streams, admission control, observers and the drain are shared with the engine-process client
(engine/frontend.py).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from pagedserve.engine.frontend import EngineFrontend, _spec_log_line  # noqa: F401 - its log line, re-exported
from pagedserve.engine.request_stream import EngineDeadError, RequestStream
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


class AsyncEngine(EngineFrontend):
    def __init__(self, engine, **kw):
        super().__init__(**kw)
        self.engine = engine
        self._lock = threading.RLock()  # around every LLMEngine call
        self._cv = threading.Condition()  # guards _cmds / _stopping / _has_work; wakes the thread
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self._pending_adds = 0
        self._has_work = False
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        with self._lock:
            self._init_stats(engine.stats())

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

    @property
    def engine_info(self):
        """config, spec, dtype, device, block_manager.num_blocks, validator of the loaded engine."""
        return self.engine

    @property
    def vocab_size(self) -> int:
        spec = getattr(self.engine, "spec", None)
        return getattr(spec, "vocab_size", None) or len(self.engine.tokenizer)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def _engine_alive(self) -> bool:
        return self._dead is None and (self._thread is None or self._thread.is_alive())

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ------------------------------------------------------------------ transport
    def _num_pending_adds(self) -> int:
        with self._cv:
            return self._pending_adds

    def _submit_add(self, request_id: str, stream: RequestStream, kwargs: dict) -> asyncio.Future:
        fut = stream._loop.create_future()
        with self._cv:
            self._cmds.append(_Cmd("add", request_id, stream, kwargs, fut))
            self._pending_adds += 1
            self._cv.notify()
        return fut

    def _send_abort(self, request_id: str) -> None:
        with self._cv:
            self._cmds.append(_Cmd("abort", request_id))
            self._cv.notify()

    def _push_to(self, stream: RequestStream, item) -> None:
        stream._push(item)

    async def _stop_engine(self) -> None:
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
                with self._cv:
                    self._has_work = has_work
                self._on_step_stats(stats, step_s)
                if outputs:
                    self._dispatch(outputs)
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
                self._pending_adds = 0
            for c in cmds:
                if c.future is not None:
                    c.stream._loop.call_soon_threadsafe(_resolve, c.future, err)
            self._fail_all(err)
            self._report_fatal(f"{type(e).__name__}: {e}")
        logger.debug("engine thread stopped")

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
                        self._pending_adds -= 1
                    c.stream._loop.call_soon_threadsafe(_resolve, c.future, err)
                else:
                    self.engine.abort_request(c.request_id)
