"""OpenAI-compatible endpoints: chat completions, completions, responses, models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from services.api.handler import ServerState, handle_generation

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await handle_generation(request, "chat", "chat_completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await handle_generation(request, "completions", "completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await handle_generation(request, "responses", "responses")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    created = int(time.time())
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "sluice",
            "root": state.config.served_model_name,
        }
        for name in state.config.model_names
    ]
    return JSONResponse({"object": "list", "data": data})
