"""`pagedserve serve`: the OpenAI-compatible HTTP server.

    pagedserve serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]

The engine core (scheduler, model runner, sampler) runs in its own process, supervised by the
server (engine/core_client.py); --no-engine-process keeps it in a thread of the server process.

SIGTERM (or Ctrl-C): stop accepting connections, let in-flight requests finish within
--shutdown-timeout seconds, abort the rest, exit 0. If the engine dies or a step hangs past
--engine-step-timeout: in-flight requests fail, /health answers 503, and the server exits 1
(or starts the engine core again with --restart-engine-on-failure).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from pagedserve.engine.args import add_engine_args, config_from_args
from pagedserve.errors import ConfigError
from pagedserve.server.tgi.launcher_args import add_tgi_launcher_args, check_tgi_args
from pagedserve.server.http_limits import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_TIMEOUT_REQUEST_HEADER


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", type=str, default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    g.add_argument("--api-key", type=str, action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes; repeat the flag for several keys "
                        "(else env PAGEDSERVE_API_KEY)")
    g.add_argument("--api-key-file", type=str, default=None,
                   help="a file with one API key per line (keeps keys out of the process list)")
    g.add_argument("--ssl-keyfile", type=str, default=None, help="serve HTTPS: the private key file (PEM)")
    g.add_argument("--ssl-certfile", type=str, default=None, help="serve HTTPS: the certificate file (PEM)")
    g.add_argument("--ssl-ca-certs", type=str, default=None,
                   help="CA certificates to verify client certificates with (see --ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*; "
                        "default: %(default)s)")
    g.add_argument("--allowed-origins", type=_json_or_str_list, nargs="+", action="extend", default=None,
                   help="enable CORS for these origins (a JSON list or plain values; default: CORS off)")
    g.add_argument("--allowed-methods", type=_json_or_str_list, nargs="+", action="extend", default=None,
                   help="CORS methods (default: all, when --allowed-origins is given)")
    g.add_argument("--allowed-headers", type=_json_or_str_list, nargs="+", action="extend", default=None,
                   help="CORS headers (default: all, when --allowed-origins is given)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="answer 413 to a larger request body, before parsing it (0: no cap; default: %(default)s)")
    g.add_argument("--timeout-request-header", type=float, default=DEFAULT_TIMEOUT_REQUEST_HEADER,
                   help="close a connection that has not sent a complete request head within this many seconds "
                        "(idle and slowloris clients; default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="close an idle keep-alive connection after this many seconds (default: %(default)s)")
    g.add_argument("--chat-template", type=str, default=None,
                   help="Jinja chat template (a file or the template text) overriding the tokenizer's")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--disable-web-ui", action="store_true",
                   help="do not serve the browser page (dashboard, chat playground, configuration) at /")
    g.add_argument("--disable-log-stats", action="store_true", help="do not log throughput every 10 s")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 + Retry-After when this many requests already wait (default: unlimited)")
    g.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="answer 503 + Retry-After when this many prompt tokens already wait (default: unlimited)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted "
                        "(default: %(default)s)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process, apart from HTTP, tokenization and "
                        "detokenization (default: on)")
    g.add_argument("--engine-step-timeout", type=float, default=60.0,
                   help="seconds one engine step may run while requests wait before the engine counts as hung "
                        "(engine process only; default: %(default)s)")
    g.add_argument("--restart-engine-on-failure", action="store_true",
                   help="start the engine core again when it dies or hangs, instead of exiting 1")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes sharing the port and one engine core, for machines with spare "
                        "cores (metrics are then per front end; default: %(default)s)")
    g.add_argument("--uvicorn-log-level", type=str, default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: %(default)s)")
    return parser


def _json_or_str_list(v: str) -> list[str]:
    """`'["https://a", "https://b"]'` (vLLM's form) or a plain value."""
    v = v.strip()
    if v.startswith("["):
        try:
            items = json.loads(v)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [v]


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).",
    )
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_server_args(p)
    add_engine_args(p)
    add_tgi_launcher_args(p)
    p.set_defaults(func=run)
    return p


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    if level in ("critical", "error", "warning"):
        logging.getLogger("pagedserve").setLevel(getattr(logging, level.upper()))


def _terminate(signum, frame):  # noqa: ARG001
    # Reached when SIGTERM arrives outside uvicorn's graceful handling (model loading) and when
    # uvicorn re-raises the signal after its graceful shutdown: either way, a clean exit 0.
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    _setup_logging(args.uvicorn_log_level)
    log = logging.getLogger("pagedserve.server")
    if getattr(args, "model_tag", None):
        if args.model and args.model != args.model_tag:
            print(f"error: two models given: {args.model_tag} and --model {args.model}", file=sys.stderr)
            return 2
        args.model = args.model_tag
    if args.model is None:
        try:
            from pagedserve.default_model import DEFAULT_MODEL_NAME, default_model_path

            args.model = str(default_model_path())
        except Exception as e:  # noqa: BLE001 - ImportError or the module's "pip install ..." RuntimeError
            print(f"error: no --model given and the default model is not available: {e}", file=sys.stderr)
            return 1
        if not args.served_model_name:
            args.served_model_name = [DEFAULT_MODEL_NAME]
    for flag, v in (("--max-num-queued-reqs", args.max_num_queued_reqs),
                    ("--max-num-queued-tokens", args.max_num_queued_tokens)):
        if v is not None and v < 0:
            print(f"error: {flag} must be >= 0", file=sys.stderr)
            return 2
    tgi_error = check_tgi_args(args)
    if tgi_error:
        print(f"error: {tgi_error}", file=sys.stderr)
        return 2
    if not args.engine_step_timeout > 0:
        print("error: --engine-step-timeout must be > 0", file=sys.stderr)
        return 2
    if args.api_server_count < 1:
        print("error: --api-server-count must be >= 1", file=sys.stderr)
        return 2
    if args.api_server_count > 1 and (args.restart_engine_on_failure or not args.engine_process):
        print("error: --api-server-count > 1 needs the engine process and no --restart-engine-on-failure",
              file=sys.stderr)
        return 2
    if args.restart_engine_on_failure and not args.engine_process:
        print("error: --restart-engine-on-failure needs the engine process (drop --no-engine-process)",
              file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):  # flatten the JSON-list form
        v = getattr(args, name, None)
        if v:
            setattr(args, name, [x for item in v for x in item])
    from pagedserve.server.auth import load_api_keys

    try:
        api_keys = load_api_keys(args.api_key, args.api_key_file)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        print("error: HTTPS needs both --ssl-keyfile and --ssl-certfile", file=sys.stderr)
        return 2
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            print(f"error: {flag}: no such file: {path}", file=sys.stderr)
            return 2
    if args.max_request_body_bytes < 0 or args.timeout_request_header <= 0 or args.timeout_keep_alive <= 0:
        print("error: --max-request-body-bytes must be >= 0 and --timeout-request-header / --timeout-keep-alive "
              "> 0", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _terminate)

    from pagedserve.server.app import load_chat_template

    try:
        load_chat_template(args.chat_template)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.api_key, args.api_key_file = api_keys, None  # read once; never logged
    if args.api_server_count > 1:
        from pagedserve.server.api_servers import run_api_servers

        return run_api_servers(args, config)
    try:
        async_engine = make_frontend(args, config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(args, config, async_engine)


def make_frontend(args: argparse.Namespace, config, attach=None, client_index: int = 0):
    """The engine as the app sees it: the engine-core process's client, or the in-process thread."""
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.core_client import EngineCoreClient

    common = dict(max_num_queued_reqs=args.max_num_queued_reqs, max_num_queued_tokens=args.max_num_queued_tokens,
                  log_requests=not args.disable_log_requests, log_stats=not args.disable_log_stats)
    if args.engine_process:
        return EngineCoreClient(config, step_timeout=args.engine_step_timeout,
                                restart_on_failure=args.restart_engine_on_failure, attach=attach,
                                client_index=client_index, **common)
    return AsyncEngine.from_config(config, **common)


def serve(args: argparse.Namespace, config, async_engine, sockets=None) -> int:
    """Run the HTTP server over `async_engine` until SIGTERM (0) or the engine's failure (1).
    `sockets`: listening sockets to serve on (several API server processes share one)."""
    import uvicorn

    from pagedserve.server.app import build_app

    log = logging.getLogger("pagedserve.server")
    api_keys = args.api_key or []
    app = build_app(async_engine, args)
    from pagedserve.server.http_limits import raise_open_files_limit, with_header_deadline

    raise_open_files_limit()
    scheme = "https" if args.ssl_certfile else "http"
    log.info("serving %s on %s://%s:%d (max_model_len=%d)%s", app.state.ctx.model_name, scheme, args.host, args.port,
             app.state.ctx.max_model_len, f" with {len(api_keys)} API key(s)" if api_keys else "")
    from pagedserve.generation_defaults import describe, generation_defaults

    log.info("%s", describe(*generation_defaults(config.generation_config, config.model)))
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        http=with_header_deadline(args.timeout_request_header),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        lifespan="on",
    )
    server = uvicorn.Server(uv_config)
    app.state.http_server = server  # the web page's live feeds end when uvicorn starts its graceful stop
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=sockets)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except KeyboardInterrupt:
        # uvicorn re-raises SIGINT after its graceful shutdown: that is a clean stop
        return 0 if server.started else 130
    if app.state.engine_failure is not None:
        print(f"error: the engine failed: {app.state.engine_failure}", file=sys.stderr)
        return 1
    return 0
