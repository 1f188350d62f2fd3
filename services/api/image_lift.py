"""Base64 images lifted out of a request body before recipe's conversion (``Converter.prepare``)."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass
class Lifted:
    """A request body whose base64 image payloads were swapped for short stand-ins before
    recipe's conversion (which otherwise copies and re-renders megabytes of base64 it only
    passes through), and the way back: stand-in data URL -> the client's data URL."""

    body: dict[str, Any]
    originals: dict[str, str]


def lift_images(body: dict[str, Any]) -> Lifted | None:
    """``body`` with every base64 image payload (Chat Completions ``image_url``, Responses
    ``input_image``, Anthropic ``image`` blocks) replaced by a stand-in that names it (a
    random per-request nonce and its index, as valid base64); None when it has none. The
    containers on the way are copied; ``body`` is not changed."""
    nonce = secrets.token_hex(8)
    originals: dict[str, str] = {}

    def stand_in(media: str, payload: str) -> str:
        token = base64.b64encode(f"sluice-lifted-{nonce}-{len(originals)}".encode()).decode()
        originals[f"data:{media};base64,{token}"] = f"data:{media};base64,{payload}"
        return token

    def data_url(url: Any) -> Any:
        if not isinstance(url, str) or not url.startswith("data:"):
            return url
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            return url
        return f"{head},{stand_in(head[5:-7], payload)}"

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(v) for v in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "image_url" and isinstance(node.get("image_url"), dict):
            return {**node, "image_url": {**node["image_url"], "url": data_url(node["image_url"].get("url"))}}
        if kind == "image_url":
            return {**node, "image_url": data_url(node.get("image_url"))}
        if kind == "input_image":
            return {**node, "image_url": data_url(node.get("image_url"))}
        src = node.get("source")
        if kind == "image" and isinstance(src, dict) and src.get("type") == "base64":
            data = src.get("data")
            if isinstance(data, str) and isinstance(src.get("media_type"), str):
                return {**node, "source": {**src, "data": stand_in(src["media_type"], data)}}
            return node
        return {k: visit(v) for k, v in node.items()}

    lifted = visit(body)
    return Lifted(lifted, originals) if originals else None
