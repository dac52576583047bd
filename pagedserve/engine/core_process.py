"""The engine core in its own process: scheduler, model runner and sampler, fed over ZeroMQ.

The loop never waits on a front end. Two threads do the I/O so that the main thread only steps:
one receives and unpickles commands into a queue, one pickles and sends each step's outputs while
the main thread already runs the next step (torch releases the GIL during compute). With work in
hand the main thread only drains what has arrived; idle, it sleeps on the command queue.

Each loop turn sends every front end one message: the acks of its adds, the deltas of its
requests (new tokens, not the cumulative output: batched per step, not per token per request),
the requests that failed, and the engine's stats. Detokenization, stop strings (where the front
end can apply them) and everything HTTP stay in the front end (engine/core_client.py).

A step that raises fails the requests of its batch (their blocks freed, cached hashes of blocks
whose KV was never written dropped) and the loop goes on serving the rest; three failing steps in
a row mean the device or the engine is broken, and the process exits non-zero so the front end
reports the engine dead. The process ignores SIGINT/SIGTERM (the front end drains and then
tells it to stop) and exits when its parent is gone.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback

from pagedserve.engine import core_messages as m

logger = logging.getLogger("pagedserve.engine")

MAX_CONSECUTIVE_STEP_FAILURES = 3
_PARENT_CHECK_S = 1.0


def run_engine_core(config, in_addr: str, out_addr: str, num_clients: int, log_level: int = logging.INFO) -> None:
    """multiprocessing target: load the engine, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    logging.getLogger("pagedserve").setLevel(log_level)
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops at its high-water mark: never drop outputs
    router.setsockopt(zmq.LINGER, 2000)
    router.bind(out_addr)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(in_addr)
    parent = os.getppid()
    clients = _await_hellos(router, num_clients, parent)
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - every start-up failure is reported, then we exit
        from pagedserve.errors import ConfigError

        msg = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, ConfigError):
            logger.error("engine core failed to start:\n%s", traceback.format_exc())
        for c in clients:
            router.send_multipart([c, m.dumps((m.STARTUP_ERROR, msg, isinstance(e, ConfigError)))])
        ctx.destroy(linger=2000)  # every socket (term() alone waits for ever on the open PULL)
        os._exit(2)
    eng = core.engine
    info = {"config": eng.config, "tokenizer": eng.tokenizer, "vocab_size": eng.spec.vocab_size,
            "stats": eng.stats(), "pid": os.getpid(), "spec": eng.spec, "dtype": eng.dtype, "device": eng.device,
            "num_blocks": eng.block_manager.num_blocks, "validator": getattr(eng, "validator", None)}
    ready = m.dumps((m.READY, info))
    for c in clients:
        router.send_multipart([c, ready])
    code = core.serve(pull, router, parent, clients)
    os._exit(code)


def _await_hellos(router, n: int, parent: int) -> list[bytes]:
    clients: list[bytes] = []
    while len(clients) < n:
        if router.poll(int(_PARENT_CHECK_S * 1000)):
            ident, _ = router.recv_multipart()
            if ident not in clients:
                clients.append(ident)
        elif os.getppid() != parent:
            os._exit(1)
    return clients


class EngineCore:
    def __init__(self, config):
        from pagedserve.engine import fault_injection
        from pagedserve.engine.engine import LLMEngine

        self.engine = LLMEngine(config)
        self.owner: dict[str, bytes] = {}  # request id -> the front end that sent it
        self.sent: dict[str, _Sent] = {}  # what each request's front end has been sent so far
        self.batch: list[str] | None = None  # request ids of the step being run
        fault = fault_injection.from_env()
        real_execute = self.engine.runner.execute

        def execute(sched, phase=None):
            self.batch = [e.seq.request.request_id for e in sched.scheduled]
            if fault is not None:
                fault_injection.check(sched, fault)
            return real_execute(sched, phase)

        self.engine.runner.execute = execute

    # ------------------------------------------------------------------ the loop
    def serve(self, pull, router, parent: int, clients: list[bytes]) -> int:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_receive, args=(pull, inbox, parent), name="core-in", daemon=True).start()
        sender = threading.Thread(target=_send, args=(router, outbox), name="core-out", daemon=True)
        sender.start()
        failures_in_a_row = 0
        stopping = False
        eng = self.engine
        code = 0
        while True:
            cmds = _drain(inbox, block=not eng.has_unfinished_requests() and not stopping)
            acks: dict[bytes, list] = {}
            for cmd in cmds:
                kind = cmd[0]
                if kind == m.ADD:
                    _, client, rid, ids, params, arrival = cmd
                    if client not in clients:
                        clients.append(client)
                    acks.setdefault(client, []).append((rid, self._add(client, rid, ids, params, arrival)))
                elif kind == m.ABORT:
                    for rid in cmd[1]:
                        self._forget(rid)
                        eng.abort_request(rid)
                elif kind == m.SHUTDOWN:
                    stopping = True
                elif kind == "parent_gone":
                    return 1
            deltas: dict[bytes, list] = {}
            failed: dict[bytes, list] = {}
            step_s = None
            if eng.has_unfinished_requests():
                self.batch = None
                t0 = time.perf_counter()
                try:
                    outputs = eng.step()
                    failures_in_a_row = 0
                except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                    failures_in_a_row += 1
                    logger.error("engine step failed (%d in a row); failing its requests:\n%s",
                                 failures_in_a_row, traceback.format_exc())
                    outputs = []
                    for rid in self._fail_step():
                        failed.setdefault(self.owner.get(rid, b""), []).append(
                            (rid, f"the engine failed while running this request: {type(e).__name__}: {e}"))
                        self._forget(rid)
                    if failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
                        code = 1
                step_s = time.perf_counter() - t0
                for out in outputs:
                    d = self._delta(out)
                    deltas.setdefault(self.owner.get(out.request_id, b""), []).append(d)
                    if out.finished:
                        self._forget(out.request_id)
            if cmds or step_s is not None:
                stats = eng.stats()
                for c in clients:
                    outbox.put((c, (m.STEP, acks.get(c, ()), deltas.get(c, ()), failed.get(c, ()), stats, step_s)))
            if code or (stopping and not eng.has_unfinished_requests()):
                outbox.put(None)
                sender.join(5.0)
                if code:
                    logger.error("%d engine steps failed in a row: stopping the engine core",
                                 MAX_CONSECUTIVE_STEP_FAILURES)
                return code

    # ------------------------------------------------------------------ requests
    def _add(self, client: bytes, rid: str, ids, params, arrival):
        try:
            self.engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=arrival)
        except Exception as e:  # noqa: BLE001 - InvalidRequestError is the expected kind; all go back
            from pagedserve.errors import InvalidRequestError

            if not isinstance(e, InvalidRequestError):
                logger.exception("add_request(%s) failed", rid)
            return e
        self.owner[rid] = client
        self.sent[rid] = _Sent(params.n)
        return None

    def _forget(self, rid: str) -> None:
        self.owner.pop(rid, None)
        self.sent.pop(rid, None)

    def _fail_step(self) -> list[str]:
        """Abort the requests of the step that raised; returns their ids."""
        eng = self.engine
        rids = self.batch if self.batch is not None else [s.request.request_id for s in eng.scheduler.running]
        rids = [r for r in dict.fromkeys(rids) if r in eng.requests]
        for rid in rids:
            eng.abort_request(rid)
        # blocks registered for the failed step's tokens never received their KV
        eng.block_manager.reset_prefix_cache()
        return rids

    def _delta(self, out) -> tuple:
        sent = self.sent.get(out.request_id) or _Sent(len(out.outputs))
        seqs = []
        for o in out.outputs:
            s = sent.choices[o.index]
            new_ids = o.token_ids[s[0]:]
            new_lps = o.logprobs[s[0]:] if o.logprobs is not None else None
            text = o.text[s[1]:] or None  # empty unless this core detokenizes the request
            s[0], s[1] = len(o.token_ids), len(o.text)
            if new_ids or text or o.finish_reason is not None:
                seqs.append((o.index, new_ids, new_lps, o.cumulative_logprob, o.finish_reason, o.stop_reason, text))
        plp = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) > sent.prompt_logprobs:
            plp = out.prompt_logprobs[sent.prompt_logprobs:]
            sent.prompt_logprobs = len(out.prompt_logprobs)
        metrics = None
        if out.finished or not sent.metrics:  # the front end needs the scheduling times once, then the end
            metrics, sent.metrics = out.metrics, True
        return (out.request_id, out.finished, seqs, plp, metrics, getattr(out, "num_cached_tokens", 0))


class _Sent:
    __slots__ = ("choices", "prompt_logprobs", "metrics")

    def __init__(self, n: int):
        self.choices = [[0, 0] for _ in range(n)]  # per choice: tokens and text characters sent
        self.prompt_logprobs = 0
        self.metrics = False


def _drain(inbox: queue.SimpleQueue, block: bool) -> list:
    out = []
    if block:
        out.append(inbox.get())
    while True:
        try:
            out.append(inbox.get_nowait())
        except queue.Empty:
            return out


def _receive(pull, inbox: queue.SimpleQueue, parent: int) -> None:
    while True:
        if pull.poll(int(_PARENT_CHECK_S * 1000)):
            inbox.put(m.loads(pull.recv(copy=False)))
        elif os.getppid() != parent:
            inbox.put(("parent_gone",))
            return


def _send(router, outbox: queue.SimpleQueue) -> None:
    while True:
        item = outbox.get()
        if item is None:
            return
        client, msg = item
        router.send_multipart([client, m.dumps(msg)], copy=False)
