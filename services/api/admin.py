"""Operator endpoints under ``/admin``: list the engines and drain one (maintenance).

They are off unless the server has admin keys (``ApiConfig.admin_keys``, from
``SLUICE_ADMIN_KEYS``): a client's API key never drains an engine. The key is sent as a
client key is (``Authorization: Bearer`` or ``x-api-key``) and compared in constant time
with every admin key (``KeyChecker``).

* ``GET /admin/engines``: one row per engine, each rank of an EP instance included (name,
  pool, host, pid, up, draining, drained, running, waiting, KV tokens), as this API process
  sees them;
* ``POST /admin/engines/{name}/drain``: the routers of every API process stop giving the
  engine new requests; it finishes those it holds (``drained`` turns true once it holds
  nothing: no request, reservation or handoff payload);
* ``POST /admin/engines/{name}/undrain``: a candidate again.

Served only by engine clients with named pools (``EnginePools``: the Ray deployment); a
single in-process engine answers 404, as there is nothing to drain apart from the server
itself (SIGTERM drains that).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from services.api.auth import KeyChecker, presented_key
from services.api.engine_client import EngineClient, EnginePools
from services.api.errors import ApiError

MAX_ENGINE_NAME = 128


def install_admin_routes(app: FastAPI, engine: EngineClient, admin_keys: tuple[str, ...]) -> None:
    keys = KeyChecker(admin_keys)

    def pools(request: Request) -> EnginePools:
        if not keys.enabled:
            raise ApiError(
                403,
                "the admin endpoints are off: start the server with SLUICE_ADMIN_KEYS set",
                code="admin_disabled",
            )
        presented = presented_key(request.headers)
        if presented is None or not keys.matches(presented):
            raise ApiError(
                401, "an admin key is needed (Authorization: Bearer <admin key>)", code="invalid_admin_key"
            )
        if not isinstance(engine, EnginePools):
            raise ApiError(
                404, "this server runs one engine: there are no engine pools to drain", code="no_engine_pools"
            )
        return engine

    async def set_draining(request: Request, name: str, draining: bool) -> dict[str, Any]:
        p = pools(request)
        try:
            return await p.set_draining(name, draining)
        except KeyError:
            known = ", ".join(row["name"] for row in p.engines())
            shown = name[:MAX_ENGINE_NAME]  # bounded: the name comes from the client
            raise ApiError(
                404, f"no engine {shown!r}; engines: {known}", param="name", code="unknown_engine"
            ) from None

    @app.get("/admin/engines")
    async def engines(request: Request) -> Response:
        return JSONResponse({"engines": pools(request).engines()})

    @app.post("/admin/engines/{name}/drain")
    async def drain(request: Request, name: str) -> Response:
        return JSONResponse(await set_draining(request, name, True))

    @app.post("/admin/engines/{name}/undrain")
    async def undrain(request: Request, name: str) -> Response:
        return JSONResponse(await set_draining(request, name, False))
