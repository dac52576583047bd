"""EngineCoreClient: the HTTP server's handle on an engine core running in its own process
(engine/core_process.py), with the same interface as AsyncEngine (engine/frontend.py).

The server process keeps what is per request and cheap to spread: tokenization and chat
templates (in the routes), detokenization and stop strings (OutputProcessor), SSE formatting,
metrics. The core only schedules, runs the model and samples, so the interpreter lock and the
cores are not shared between HTTP work and the engine loop.

Transport: commands are pickled and pushed (PUSH, never blocks); one receiver thread reads the
core's per-step messages (DEALER), updates the stats snapshot, and hands each step's acks and
deltas to the event loop in one call. The same thread supervises the core: a process that exits,
or a step that runs past `step_timeout` seconds while requests are in flight, fails every
in-flight request with EngineDeadError and turns `is_alive()` (so /health) false at once; then
the core is started again (`restart_on_failure`) or `on_fatal(reason)` tells the server to exit.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from types import SimpleNamespace

from pagedserve.engine import core_messages as m
from pagedserve.engine.core_process import run_engine_core
from pagedserve.engine.frontend import EngineFrontend
from pagedserve.engine.output_processor import OutputProcessor, params_for_core
from pagedserve.engine.request_stream import EngineDeadError, EngineStepError, RequestStream
from pagedserve.errors import ConfigError

logger = logging.getLogger("pagedserve.engine")

_POLL_MS = 100  # supervision granularity: a dead core is noticed within this


class _OtherProcess:
    """The core when this process did not start it (several API servers share one core): the
    supervisor that started it reaps it, this process only watches it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode = None

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)


class _CoreProcess:
    """One incarnation of the engine core: its process and the two sockets that reach it.
    `attach=(in_addr, out_addr, pid)` connects to a core another process started."""

    def __init__(self, config, client_id: bytes, attach: tuple[str, str, int] | None = None):
        import zmq

        self.owned = attach is None
        self.dir = tempfile.mkdtemp(prefix="pagedserve-core-") if self.owned else None
        in_addr, out_addr = (f"ipc://{self.dir}/in", f"ipc://{self.dir}/out") if self.owned else attach[:2]
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(in_addr)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, client_id)
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(out_addr)
        if self.owned:
            self.proc = spawn_core(config, in_addr, out_addr, 1)
        else:
            self.proc = _OtherProcess(attach[2])
        self.dealer.send(m.HELLO)
        self.last_recv = time.monotonic()
        self.dead_reason: str | None = None
        self.closing = False
        self.thread: threading.Thread | None = None

    def wait_ready(self) -> dict:
        # the ready message carries the tokenizer: import its library while the core loads the model
        import transformers  # noqa: F401

        while True:
            if self.dealer.poll(200):
                msg = m.loads(self.dealer.recv())
                if msg[0] == m.READY:
                    return msg[1]
                if msg[0] == m.STARTUP_ERROR:
                    self.proc.join(10)
                    self.close()
                    raise (ConfigError if msg[2] else RuntimeError)(msg[1])
            elif not self.proc.is_alive():
                code = self.proc.exitcode
                self.close()
                raise RuntimeError(f"the engine core process exited with code {code} while starting")

    def send(self, msg) -> None:
        self.push.send(m.dumps(msg), copy=False)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def spawn_core(config, in_addr: str, out_addr: str, num_clients: int):
    """Start the engine-core process (it binds both addresses and waits for `num_clients` hellos)."""
    level = logging.getLogger("pagedserve").getEffectiveLevel()
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(config, in_addr, out_addr, num_clients, level), name="pagedserve-engine-core",
        daemon=True)
    proc.start()
    # The core ignores SIGTERM (it must outlive the drain), so multiprocessing's own exit handler,
    # which terminates and then joins it, would wait for ever: kill it first.
    atexit.register(lambda: proc.is_alive() and proc.kill())
    return proc


class EngineCoreClient(EngineFrontend):
    def __init__(self, config, *, step_timeout: float = 60.0, restart_on_failure: bool = False,
                 attach: tuple[str, str, int] | None = None, client_index: int = 0, **kw):
        """attach=(in_addr, out_addr, pid): use a core another process started (--api-server-count);
        it is then not restarted here."""
        super().__init__(**kw)
        self._config_in = copy.deepcopy(config)  # as given: each restart resolves it again
        self.step_timeout = step_timeout
        self.restart_on_failure = restart_on_failure
        self._client_id = f"frontend-{os.getpid()}-{client_index}".encode()
        self._pending: dict[str, asyncio.Future] = {}
        self._busy_since = time.monotonic()
        self._stopping = False
        if attach is not None and restart_on_failure:
            raise ConfigError("--restart-engine-on-failure needs a single API server (--api-server-count 1)")
        self._core = _CoreProcess(copy.deepcopy(self._config_in), self._client_id, attach)
        try:
            info = self._core.wait_ready()
        except BaseException:
            self._core.kill()
            raise
        self.config = info["config"]
        self.tokenizer = info["tokenizer"]
        self.vocab_size = info["vocab_size"]
        self.core_pid = info["pid"]
        self.engine_info = SimpleNamespace(
            config=self.config, tokenizer=self.tokenizer, spec=info["spec"], dtype=info["dtype"],
            device=info["device"], block_manager=SimpleNamespace(num_blocks=info["num_blocks"]),
            validator=info["validator"])
        self._processor = OutputProcessor(self.tokenizer)
        self._init_stats(info["stats"])
        logger.info("engine core running in process %d", self.core_pid)
        self._start_receiver(self._core)

    @classmethod
    def from_config(cls, config, **kw) -> "EngineCoreClient":
        return cls(config, **kw)

    # ------------------------------------------------------------------ state
    def _engine_alive(self) -> bool:
        core = self._core
        return core is not None and core.dead_reason is None and not core.closing and core.proc.is_alive()

    def _num_pending_adds(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ commands (event loop)
    def _submit_add(self, request_id: str, stream: RequestStream, kwargs: dict) -> asyncio.Future:
        from pagedserve.sampling_params import SamplingParams

        fut = stream._loop.create_future()
        params = kwargs["params"] or SamplingParams()
        ids = kwargs["prompt_token_ids"]
        if ids is None and isinstance(kwargs["prompt"], str) and kwargs["prompt"]:
            ids = self.tokenizer.encode(kwargs["prompt"])
        if not self._pending and self.num_in_flight() <= 1:
            self._busy_since = time.monotonic()
        self._pending[request_id] = fut
        self._processor.add(request_id, kwargs["prompt"], ids or [], params)
        self._core.send((m.ADD, self._client_id, request_id, ids, params_for_core(params), kwargs["arrival_time"]))
        return fut

    def _send_abort(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._processor.drop(request_id)
        if self._engine_alive():
            self._core.send((m.ABORT, [request_id]))

    def _push_to(self, stream: RequestStream, item) -> None:
        stream._put_nowait(item)  # always called on the event loop here

    # ------------------------------------------------------------------ outputs (receiver thread)
    def _start_receiver(self, core: _CoreProcess) -> None:
        core.thread = threading.Thread(target=self._receive, args=(core,), name="pagedserve-core-receiver",
                                       daemon=True)
        core.thread.start()

    def _receive(self, core: _CoreProcess) -> None:
        dealer = core.dealer
        reason = None
        while reason is None:
            if dealer.poll(_POLL_MS):
                msg = m.loads(dealer.recv(copy=False))
                core.last_recv = time.monotonic()
                if msg[0] == m.STEP:
                    _, acks, deltas, failed, stats, step_s = msg
                    self._on_step_stats(stats, step_s)
                    if acks or deltas or failed:
                        self._post(self._handle_step, core, acks, deltas, failed)
                continue
            if core.closing:
                return
            if not core.proc.is_alive():
                reason = f"the engine core process exited unexpectedly (exit code {core.proc.exitcode})"
            elif (self._pending or self.num_in_flight()) and \
                    time.monotonic() - max(core.last_recv, self._busy_since) > self.step_timeout:
                core.kill()
                reason = f"an engine step ran longer than --engine-step-timeout ({self.step_timeout:g} s)"
            elif self.log_stats:
                self._maybe_log(self._stats)
        core.dead_reason = reason  # /health turns 503 from here on
        logger.error("engine core failed: %s", reason)
        self._post(self._on_core_failure, core, reason)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None:
            fn(*args)  # nothing was ever submitted: no stream to reach
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _handle_step(self, core: _CoreProcess, acks, deltas, failed) -> None:
        if core is not self._core:
            return  # from an incarnation that has been replaced
        for rid, err in acks:
            fut = self._pending.pop(rid, None)
            if err is not None:
                self._processor.drop(rid)
            if fut is not None and not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)
        outs, stopped = [], []
        process = self._processor.process
        for d in deltas:
            out, stop_here = process(d)
            if out is not None:
                outs.append(out)
            if stop_here:
                stopped.append(d[0])
        if stopped:  # ended by a stop string here: the core must free their blocks
            core.send((m.ABORT, stopped))
        if outs:
            self._dispatch(outs)
        for rid, message in failed:
            self._processor.drop(rid)
            self._end_stream(rid, EngineStepError(message))

    def _end_stream(self, rid: str, err: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.dequeued:
                stream.dequeued = True
                self._queued_tokens -= stream.num_prompt_tokens
        if stream is not None:
            stream._put_nowait(err)

    # ------------------------------------------------------------------ failure and restart
    def _on_core_failure(self, core: _CoreProcess, reason: str) -> None:
        if core is not self._core or core.closing:
            return
        core.closing = True
        core.kill()
        err = EngineDeadError(f"the engine failed: {reason}")
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._processor.clear()
        self._fail_all(err)
        threading.Thread(target=self._reap, args=(core,), daemon=True).start()
        if self.restart_on_failure and self._accepting and not self._stopping:
            threading.Thread(target=self._restart, name="pagedserve-core-restart", daemon=True).start()
        else:
            self._report_fatal(reason)

    @staticmethod
    def _reap(core: _CoreProcess) -> None:
        if core.owned:
            core.proc.join(10)
        if core.thread is not None and core.thread is not threading.current_thread():
            core.thread.join(5)
        core.close()

    def _restart(self) -> None:
        t0 = time.monotonic()
        logger.warning("restarting the engine core (--restart-engine-on-failure)")
        try:
            core = _CoreProcess(copy.deepcopy(self._config_in), self._client_id)
            info = core.wait_ready()
        except Exception as e:  # noqa: BLE001
            logger.error("the engine core could not be restarted: %s", e)
            self._post(self._report_fatal, f"restart failed: {e}")
            return
        self._post(self._adopt, core, info, time.monotonic() - t0)

    def _adopt(self, core: _CoreProcess, info: dict, seconds: float) -> None:
        if self._stopping:
            core.kill()
            threading.Thread(target=self._reap, args=(core,), daemon=True).start()
            return
        self._core = core
        self.core_pid = info["pid"]
        self._init_stats(info["stats"])
        self._start_receiver(core)
        logger.warning("engine core restarted in process %d after %.1f s", self.core_pid, seconds)

    # ------------------------------------------------------------------ shutdown
    async def _stop_engine(self) -> None:
        self._stopping = True
        core = self._core
        if core is None or core.closing:
            return
        core.closing = True
        if not core.owned:  # the supervisor stops the shared core once every API server is done
            await asyncio.to_thread(self._reap, core)
            return
        if core.proc.is_alive():
            core.send((m.SHUTDOWN,))
            await asyncio.to_thread(core.proc.join, 10.0)
        core.kill()
        await asyncio.to_thread(self._reap, core)
