"""`--api-server-count N`: N HTTP front-end processes accept on one listening socket and share one
engine-core process, for machines whose spare cores can take the HTTP, tokenization and
detokenization work of many clients.

This process only supervises: it binds the socket, starts the core (which waits for N front ends)
and the N API servers (each an EngineCoreClient attached to the core, serving with uvicorn on the
inherited socket). SIGTERM / Ctrl-C is passed to the API servers, which drain as one server does;
when all have exited the core is told to stop. If the core dies, every API server fails its
requests, answers 503 and exits 1, and so does this process. Metrics are per API server.
"""
from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import wait

from pagedserve.engine import core_messages as m

log = logging.getLogger("pagedserve.server")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_server(args, config, attach, index: int, sock: socket.socket) -> None:
    """Entry point of one API server process."""
    from pagedserve.errors import ConfigError
    from pagedserve.server.cli import _setup_logging, _terminate, make_frontend, serve

    _setup_logging(args.uvicorn_log_level)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        frontend = make_frontend(args, config, attach=attach, client_index=index)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(args, config, frontend, sockets=[sock]))


def run_api_servers(args, config) -> int:
    import zmq

    from pagedserve.engine.core_client import spawn_core

    n = args.api_server_count
    sock = _listen(args.host, args.port)
    workdir = tempfile.mkdtemp(prefix="pagedserve-core-")
    in_addr, out_addr = f"ipc://{workdir}/in", f"ipc://{workdir}/out"
    core = spawn_core(copy.deepcopy(config), in_addr, out_addr, n)
    spawn = multiprocessing.get_context("spawn")
    servers = [spawn.Process(target=_api_server, args=(args, config, (in_addr, out_addr, core.pid), i, sock),
                             name=f"pagedserve-api-server-{i}", daemon=True) for i in range(n)]
    for s in servers:
        s.start()
    log.info("%d API servers on %s:%d, engine core in process %d", n, args.host, args.port, core.pid)
    stopping = False

    def stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True
        for s in servers:
            if s.is_alive():
                os.kill(s.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    try:
        while any(s.is_alive() for s in servers):
            wait([s.sentinel for s in servers], timeout=0.5)
            failed = [s for s in servers if s.exitcode not in (None, 0)]
            if failed and not stopping:  # one went down (the engine failed): take the rest down
                code = failed[0].exitcode
                log.error("API server %s exited with %s: stopping", failed[0].name, code)
                stop(None, None)
            elif failed and code == 0:
                code = failed[0].exitcode
    finally:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(in_addr)
        if core.is_alive():
            push.send(m.dumps((m.SHUTDOWN,)))
            core.join(15)
        if core.is_alive():
            core.kill()
            core.join(5)
        ctx.destroy(linger=0)
        sock.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return code
