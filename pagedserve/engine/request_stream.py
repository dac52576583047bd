"""What AsyncEngine hands its callers: a RequestStream per request (an async iterator of cumulative
RequestOutputs that coalesces for slow consumers), the observer hooks, and the errors the server
maps to HTTP statuses."""
from __future__ import annotations

import asyncio
import collections
import copy
from typing import Any


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a bug or a device error); nothing more can be served."""


class EngineStepError(RuntimeError):
    """A model step failed while this request was in it; the engine goes on serving others."""


class EngineShuttingDownError(RuntimeError):
    """The engine no longer accepts requests (graceful shutdown in progress)."""


class QueueFullError(RuntimeError):
    """Admission control: too many requests / prompt tokens are already waiting."""

    def __init__(self, message: str, reason: str, retry_after: int = 1):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class RequestAbortedError(RuntimeError):
    """The request was aborted before it produced any output."""


class EngineObserver:
    """Hooks called from the engine thread (metrics). All are optional no-ops here."""

    def on_step(self, stats: Any, step_seconds: float) -> None: ...

    def on_request_output(self, stream: "RequestStream", output: Any, num_new_tokens: int, now: float) -> None: ...

    def on_request_finished(self, stream: "RequestStream", output: Any, now: float) -> None: ...

    def on_request_aborted(self, stream: "RequestStream", now: float) -> None: ...


_ABORTED = object()  # stream sentinel: aborted locally (client gone / shutdown)


class RequestStream:
    """Async iterator of cumulative RequestOutputs for one request; ends after the finished one."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, num_prompt_tokens: int,
                 arrival_time: float):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._event = asyncio.Event()
        self._done = False  # consumer side: the end was returned
        self._last = None  # last RequestOutput handed to the consumer
        # engine-side bookkeeping (engine thread, or the loop thread under _streams_lock)
        self.aborted = False
        self.finished = False
        self.dequeued = False  # no longer counted as "queued" for admission control
        self.tokens_seen = 0  # total generated tokens over all choices seen so far
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.user: dict = {}  # free slot for observers

    # -- producer side ------------------------------------------------------------------------
    def _put_nowait(self, item) -> None:  # runs on the loop thread
        self._items.append(item)
        self._event.set()

    def _push(self, item) -> None:
        """Hand an item to the consumer from any thread."""
        try:
            self._loop.call_soon_threadsafe(self._put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    # -- consumer side ------------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self.next()
        return out

    async def next(self, timeout: float | None = None):
        """The latest output (cumulative), or None if `timeout` seconds passed without one.

        Raises StopAsyncIteration after the finished output, the engine's error if it died,
        RequestAbortedError if aborted before any output.
        """
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._event.clear()
            if self._items:
                break
            if timeout is None:
                await self._event.wait()
            else:
                try:
                    await asyncio.wait_for(self._event.wait(), timeout)
                except asyncio.TimeoutError:
                    if not self._items:
                        return None
        item = self._items.popleft()
        # Coalesce: outputs are cumulative, only the newest matters (stop at a terminal item).
        while self._items and not self._terminal(item):
            self._last = item
            item = self._items.popleft()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is _ABORTED:
            self._done = True
            if self._last is None:
                raise RequestAbortedError(f"request {self.request_id} was aborted")
            return _as_aborted(self._last)
        self._last = item
        if getattr(item, "finished", False):
            self._done = True
        return item

    @staticmethod
    def _terminal(item) -> bool:
        return item is _ABORTED or isinstance(item, BaseException) or getattr(item, "finished", False)

    @property
    def done(self) -> bool:
        return self._done


def _as_aborted(out):
    """A finished copy of the last output with finish_reason 'abort' on unfinished choices."""
    out = copy.copy(out)
    outs = []
    for o in out.outputs:
        o = copy.copy(o)
        if o.finish_reason is None:
            o.finish_reason = "abort"
        outs.append(o)
    out.outputs = outs
    out.finished = True
    return out
