"""Anthropic-compatible endpoint: ``POST /v1/messages`` (errors in Anthropic's shape)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.api.handler import handle_generation

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await handle_generation(request, "messages", "messages")
