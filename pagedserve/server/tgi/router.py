"""TGI's routes: POST /generate, POST /generate_stream, POST / (either, by `stream`), GET /info.

Errors on these routes use TGI's body ({"error", "error_type"}) and status codes (422 for bad
input, 429 when overloaded), which TGI clients turn into their own exception types.
"""
from __future__ import annotations

import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.server.tgi.concurrency import ConcurrencyLimitMiddleware
from pagedserve.server.tgi.metrics import TGIMetricsCollector
from pagedserve.server.tgi.protocol import MAX_BEST_OF, MAX_STOP_SEQUENCES, GenerateRequest, TGIError
from pagedserve.server.tgi.serving import TGIServing

TGI_PATHS = ("/", "/generate", "/generate_stream")


def _error(e: TGIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers)


async def _parse(raw: Request) -> GenerateRequest:
    try:
        data = json.loads(await raw.body())
    except ValueError as e:
        raise TGIError(f"Failed to deserialize the JSON body: {e}") from None
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            what = "unknown field (pagedserve does not implement it)" if err.get("type") == "extra_forbidden" \
                else err.get("msg", "invalid value")
            parts.append(f"`{where}`: {what}" if where else what)
        raise TGIError("; ".join(parts) or "invalid request") from None


def _version() -> str:
    from pagedserve import __version__

    return __version__


def build_router(ctx, max_concurrent_requests: int | None = None) -> APIRouter:
    serving = TGIServing(ctx)
    router = APIRouter()

    async def run(raw: Request, stream: bool | None):
        try:
            req = await _parse(raw)
            if stream is not None and req.stream and not stream:
                raise TGIError("`stream`: true is for POST /generate_stream (or POST /)")
            if stream if stream is not None else req.stream:
                return await serving.generate_stream(req)
            body = await serving.generate(req, raw)
        except TGIError as e:
            return _error(e)
        return Response(status_code=499) if body is None else JSONResponse(body)

    @router.post("/generate")
    async def generate(raw: Request):
        return await run(raw, False)

    @router.post("/generate_stream")
    async def generate_stream(raw: Request):
        return await run(raw, True)

    @router.post("/")
    async def compat_generate(raw: Request):
        return await run(raw, None)

    @router.get("/info")
    async def info():
        cfg = ctx.engine.config
        engine = getattr(ctx.engine, "engine_info", None)  # the loaded engine's facts, wherever it runs
        dtype = str(getattr(engine, "dtype", cfg.dtype)).replace("torch.", "")
        device = getattr(getattr(engine, "device", None), "type", None) or cfg.device
        max_input = getattr(cfg, "max_input_tokens", None) or (ctx.max_model_len - 1)
        return {
            "model_id": ctx.model_name,
            "model_sha": None,
            "model_dtype": dtype,
            "model_device_type": device,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": max_concurrent_requests,
            "max_best_of": MAX_BEST_OF,
            "max_stop_sequences": MAX_STOP_SEQUENCES,
            "max_input_tokens": max_input,
            "max_input_length": max_input,
            "max_total_tokens": ctx.max_model_len,
            "max_batch_size": cfg.max_num_seqs,
            "max_batch_prefill_tokens": cfg.max_num_batched_tokens,
            "validation_workers": 1,
            "max_client_batch_size": 1,
            "router": "pagedserve",
            "version": _version(),
            "sha": None,
            "docker_label": None,
            # what pagedserve adds: the engine flags `pagedserve doctor` reasons about
            "pagedserve_config": {
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_model_len": cfg.max_model_len,
                "enable_chunked_prefill": cfg.enable_chunked_prefill,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "block_size": cfg.block_size,
                "kv_cache_space": cfg.kv_cache_space,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "num_gpu_blocks_override": cfg.num_gpu_blocks_override,
                "device": device,
                "dtype": dtype,
            },
        }

    return router


def register_tgi(app: FastAPI, ctx, args) -> None:
    """Mount TGI's routes (and, by flag, its concurrency limit and metric names) on the app."""
    limit = getattr(args, "max_concurrent_requests", None)
    app.include_router(build_router(ctx, limit))
    if limit is not None:
        app.add_middleware(ConcurrencyLimitMiddleware, limit=limit)
    if getattr(args, "tgi_metrics", False) and ctx.metrics is not None:
        ctx.metrics.registry.register(TGIMetricsCollector(ctx.metrics))
