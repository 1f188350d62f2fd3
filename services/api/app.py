"""``create_app(config, engine_client)``: the FastAPI application, no globals.

Layers, outside in: ``GuardMiddleware`` (header size, API key, body size), FastAPI
routing, ``handle_generation`` (limits, admission, recipe conversion, engine). Errors of
every layer leave in the protocol's shape: Anthropic's for ``/v1/messages``, OpenAI's
elsewhere. The engine client is started and closed by the app's lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from services.api.admin import install_admin_routes
from services.api.admission import AdmissionController
from services.api.auth import KeyChecker
from services.api.config import ApiConfig
from services.api.convert import Converter
from services.api.engine_client import EngineClient
from services.api.errors import ApiError, error_response
from services.api.handler import ServerState
from services.api.metrics import ApiMetrics, MetricsSource
from services.api.middleware import GuardMiddleware

log = logging.getLogger(__name__)


def create_app(config: ApiConfig, engine: EngineClient) -> FastAPI:
    info = engine.model_info()
    cfg = config.resolve(info.model_id, info.context_limit)
    metrics = ApiMetrics(engine.stats, [engine] if isinstance(engine, MetricsSource) else [])
    admission = AdmissionController(
        cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s, cfg.retry_after_s
    )
    state = ServerState(cfg, engine, Converter(cfg, info), admission, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="Sluice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sluice = state
    _install_handlers(app, metrics)
    _install_ops_routes(app, state)
    install_admin_routes(app, engine, cfg.admin_keys)
    from services.api.routes_anthropic import router as anthropic_router
    from services.api.routes_openai import router as openai_router

    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.add_middleware(
        GuardMiddleware,
        keys=KeyChecker(cfg.api_keys),
        max_header_bytes=cfg.max_header_bytes,
        max_body_bytes=cfg.max_body_bytes,
        on_reject=lambda reason, _path: metrics.reject(reason),
    )
    return app


def _install_handlers(app: FastAPI, metrics: ApiMetrics) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        metrics.reject(err.param or err.code or str(err.status))
        endpoint = request.url.path.rsplit("/", 1)[-1]
        metrics.requests.labels(endpoint=endpoint, status=str(err.status)).inc()
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        metrics.requests.labels(endpoint=request.url.path.rsplit("/", 1)[-1], status="500").inc()
        err = ApiError(500, "internal server error", code="internal_error")
        return error_response(err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return error_response(err, request.url.path)


def _install_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok = await state.engine.ready(timeout_s=5.0)
        if not ok:
            return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready", "model": state.config.served_model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        s = state.admission.stats
        state.metrics.in_flight.set(s.running)
        state.metrics.queued.set(s.queued)
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
