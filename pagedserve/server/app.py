"""The FastAPI application: OpenAI-compatible routes over an AsyncEngine.

`build_app(async_engine, args)` wires routes, error handling (OpenAI error bodies; 400 for every
kind of bad input, never 422/500), the optional API key, and metrics. `async_engine` is an
AsyncEngine (engine thread in this process) or an EngineCoreClient (engine core in its own
process); both have the interface of engine/frontend.py. The app's lifespan starts the engine
and, on shutdown, lets in-flight requests finish (up to --shutdown-timeout) before aborting the
rest. When the engine is gone for good (the core process died or hung and is not restarted),
/health answers 503 at once and `app.state.stop_server` (set by `pagedserve serve`) is called
shortly after, so the server exits non-zero (`app.state.engine_failure` holds the reason).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.frontend import EngineFrontend
from pagedserve.errors import InvalidRequestError
from pagedserve.generation_defaults import generation_defaults
from pagedserve.server.auth import APIKeyMiddleware, load_api_keys
from pagedserve.server.http_limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from pagedserve.server.http_metrics import HTTPMetrics, HTTPMetricsMiddleware
from pagedserve.server.metrics import ServerMetrics, StepCostModel
from pagedserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    error_body,
)
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_base import ServingContext, default_ping_seconds
from pagedserve.server.serving_completions import OpenAIServingCompletion
from pagedserve.server.serving_responses import OpenAIServingResponses
from pagedserve.server.tgi.router import register_tgi
from pagedserve.server.web import mount_web_ui
from pagedserve.server.web.engine_config import engine_configuration

logger = logging.getLogger("pagedserve.server")

def _version() -> str:
    try:
        from pagedserve import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def system_fingerprint(model: str, dtype: str) -> str:
    """OpenAI's system_fingerprint: changes when the serving software or model configuration does."""
    import hashlib

    return "fp_" + hashlib.sha256(f"pagedserve {_version()} {model} {dtype}".encode()).hexdigest()[:10]


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path, or the Jinja template itself."""
    if value is None:
        return None
    p = Path(value).expanduser()
    try:
        if p.is_file():
            return p.read_text()
    except OSError:
        pass
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".txt"))):
        raise ValueError(f"--chat-template: no such file: {value}")
    if "\\n" in value and "\n" not in value:  # a one-line template from a shell: unescape newlines
        value = value.replace("\\n", "\n")
    return value


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status_code, e.type, e.param, e.code), status_code=e.status_code,
                        headers=e.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Invalid JSON in the request body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    return ("; ".join(parts) or "Invalid request."), param


def _cache_config(engine) -> dict:
    """cache_config_info's labels (vLLM's names)."""
    cfg = engine.config
    bm = getattr(engine, "block_manager", None)
    return {"block_size": cfg.block_size, "num_gpu_blocks": getattr(bm, "num_blocks", ""),
            "cache_dtype": str(getattr(engine, "dtype", cfg.dtype)).replace("torch.", ""),
            "enable_prefix_caching": cfg.enable_prefix_caching, "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "cpu_kvcache_space_gib": cfg.kv_cache_space}


def _cost_model(engine) -> StepCostModel | None:
    spec, dtype = getattr(engine, "spec", None), getattr(engine, "dtype", None)
    if spec is None or not hasattr(spec, "num_layers") or dtype is None:
        return None
    import torch

    return StepCostModel.from_spec(spec, str(getattr(engine, "device", "cpu")),
                                   torch.tensor([], dtype=dtype).element_size())


# After the engine is gone for good, /health keeps answering 503 this long before the server exits,
# so that health checkers see why it went away.
DEAD_ENGINE_EXIT_DELAY_S = 1.5


def build_app(async_engine: EngineFrontend, args: argparse.Namespace | None = None) -> FastAPI:
    args = args or argparse.Namespace()
    engine = async_engine.engine_info  # facts about the loaded engine, wherever it runs
    cfg = async_engine.config
    names = getattr(args, "served_model_name", None) or []
    if isinstance(names, str):
        names = [names]
    names = list(names) or [cfg.served_model_name or str(cfg.model)]
    vocab = async_engine.vocab_size
    shutdown_timeout = float(getattr(args, "shutdown_timeout", 30.0) or 0.0)

    metrics = ServerMetrics(names[0], cfg.max_model_len or 8192, stats_fn=async_engine.stats,
                            cache_config=_cache_config(engine), cost=_cost_model(engine))
    async_engine.observer = metrics
    ctx = ServingContext(
        engine=async_engine,
        served_model_names=names,
        model_path=str(cfg.model),
        max_model_len=cfg.max_model_len,
        vocab_size=vocab,
        max_logprobs=cfg.max_logprobs,
        metrics=metrics,
        chat_template=load_chat_template(getattr(args, "chat_template", None)),
        log_requests=not getattr(args, "disable_log_requests", False),
        ping_seconds=default_ping_seconds(),
        system_fingerprint=system_fingerprint(str(cfg.model), str(getattr(engine, "dtype", cfg.dtype))),
        sampling_defaults=generation_defaults(cfg.generation_config, cfg.model)[0],
    )
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    responses = OpenAIServingResponses(ctx)
    http_metrics = HTTPMetrics(metrics.registry)

    def engine_failed(reason: str) -> None:  # on the event loop
        if app.state.engine_failure is None:
            logger.error("the engine is gone (%s): the server stops", reason)
        app.state.engine_failure = reason
        stop = app.state.stop_server
        if stop is not None:
            asyncio.get_running_loop().call_later(DEAD_ENGINE_EXIT_DELAY_S, stop)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.bind_loop(asyncio.get_running_loop())
        async_engine.on_fatal = engine_failed
        async_engine.start()
        if app.state.stats_feed is not None:
            app.state.stats_feed.start()
        yield
        if app.state.stats_feed is not None:
            await app.state.stats_feed.stop()
        await async_engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="pagedserve", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.async_engine = async_engine
    app.state.engine_failure = None
    app.state.stop_server = None
    app.state.ctx = ctx
    app.state.metrics = metrics

    # -- errors: OpenAI's body, 400 for any bad input --------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return _error_response(APIError(str(e), 400, param=e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        msg, param = _validation_message(e)
        return _error_response(APIError(msg, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return _error_response(APIError(str(e.detail), e.status_code, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        logger.exception("unhandled error")
        return _error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500))

    # Starlette runs the last added middleware first: CORS answers preflights before the key check,
    # and the body cap applies to everyone.
    api_keys = load_api_keys(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    origins = getattr(args, "allowed_origins", None)
    if origins:  # CORS stays off (browsers refuse cross-origin reads) unless origins are named
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins,
                           allow_credentials=bool(getattr(args, "allow_credentials", False)),
                           allow_methods=getattr(args, "allowed_methods", None) or ["*"],
                           allow_headers=getattr(args, "allowed_headers", None) or ["*"])
    max_body = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    if max_body:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body)
    app.add_middleware(HTTPMetricsMiddleware, metrics=http_metrics)  # outermost: counts 401s and 413s too

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if async_engine.is_alive():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine is not running", 503, code="engine_dead"), status_code=503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/load")
    async def load():
        return {"server_load": http_metrics.server_load}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=n, root=ctx.model_path, max_model_len=ctx.max_model_len)
                               for n in names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        completions.check_model(model_id)
        return ModelCard(id=model_id, root=ctx.model_path, max_model_len=ctx.max_model_len).model_dump()

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return await responses.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await completions.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await completions.detokenize(request)

    @app.get("/metrics")
    async def prometheus_metrics():
        body, ctype = metrics.render()
        return Response(content=body, media_type=ctype)

    register_tgi(app, ctx, args)  # TGI's routes, flags and metric names

    app.state.stats_feed = None
    if not getattr(args, "disable_web_ui", False):
        def shutting_down() -> bool:  # uvicorn's graceful stop (cli.py sets http_server) or the engine's
            server = getattr(app.state, "http_server", None)
            return bool(getattr(server, "should_exit", False)) or not async_engine.accepting

        app.state.stats_feed = mount_web_ui(
            app, read_metrics=lambda: metrics.render()[0], api_key_required=bool(api_keys),
            configuration=lambda kv_blocks: engine_configuration(async_engine, args, names, _version(), kv_blocks,
                                                                 bool(api_keys)),
            alive=async_engine.is_alive, shutting_down=shutting_down,
            doctor_config=lambda: {k: v for k, v in dataclasses.asdict(async_engine.config).items() if k != "extra"})

    return app
