"""Limits on what a client controls inside the JSON body, checked before conversion.

deepseek-recipe validates types, ranges of its own fields, model names and JSON schemas;
these checks add the bounds it leaves to the server (n, top_logprobs, prompt size,
max_tokens against the deployment, tool and schema sizes, regex validity, images) and
run in one pass over the parsed body, before anything is tokenised. Every violation is an
``ApiError`` whose ``param`` is the ``ApiConfig`` field name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from services.api.config import ApiConfig
from services.api.errors import ApiError, limit_error
from services.api.image_cache import PreprocessCache
from services.api.images import ImageLimits, check_image_ref

MAX_JSON_NODES = 2_000_000


@dataclass
class BodyFacts:
    """What the walk found: image references (path, url or raw base64) and prompt text size."""

    images: list[tuple[str, str]] = field(default_factory=list)
    text_chars: int = 0


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", param="body")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", param="body")
    return body


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(value)[:40]}", param=name)
    return value


def check_generation(body: dict[str, Any], kind: str, cfg: ApiConfig) -> None:
    """n, max_tokens, logprobs, stop bounds and ``swa_replay`` for one endpoint kind."""
    n = _int_field(body, "n")
    if n is not None and not 1 <= n <= cfg.max_n:
        raise limit_error("max_n", f"n={n} is not supported; at most {cfg.max_n}")
    token_fields = {
        "chat": ("max_tokens", "max_completion_tokens"),
        "completions": ("max_tokens",),
        "responses": ("max_output_tokens",),
        "messages": (),  # Messages lowers an over-large max_tokens to the bound (recipe's rule)
    }[kind]
    for name in token_fields:
        value = _int_field(body, name)
        if value is not None and value > cfg.max_tokens_limit:
            raise limit_error("max_tokens_limit", f"{name}={value} exceeds {cfg.max_tokens_limit}")
        if value is not None and value < 1:
            raise ApiError(400, f"{name} must be >= 1, got {value}", param=name)
    mode = body.get("swa_replay")
    if mode is not None and mode not in ("exact", "bounded"):
        raise ApiError(
            400,
            f"swa_replay must be 'exact' (a prefix hit never changes the output) or 'bounded' "
            f"(cheaper, approximate), got {mode!r}",
            param="swa_replay",
        )
    lp_name = "logprobs" if kind == "completions" else "top_logprobs"
    top = _int_field(body, lp_name)
    if top is not None and not 0 <= top <= cfg.max_top_logprobs:
        raise limit_error("max_top_logprobs", f"{lp_name}={top} is outside [0, {cfg.max_top_logprobs}]")
    stop = body.get("stop_sequences" if kind == "messages" else "stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > cfg.max_stop_sequences:
        raise limit_error(
            "max_stop_sequences", f"{len(stops)} stop sequences, more than {cfg.max_stop_sequences}"
        )
    for s in stops:
        if isinstance(s, str) and len(s) > cfg.max_stop_chars:
            raise limit_error(
                "max_stop_chars", f"a stop sequence of {len(s)} chars exceeds {cfg.max_stop_chars}"
            )


def check_tools_and_formats(body: dict[str, Any], cfg: ApiConfig) -> None:
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > cfg.max_tools:
            raise limit_error("max_tools", f"{len(tools)} tools, more than {cfg.max_tools}")
        size = len(json.dumps(tools))
        if size > cfg.max_tools_bytes:
            raise limit_error(
                "max_tools_bytes", f"tools are {size} bytes of JSON, more than {cfg.max_tools_bytes}"
            )
    fmt = body.get("response_format")
    text = body.get("text")
    if not isinstance(fmt, dict) and isinstance(text, dict):
        fmt = text.get("format")  # Responses: text.format
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind == "json_schema":
        inner = fmt.get("json_schema", fmt)
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema is not None:
            raw = json.dumps(schema)
            if len(raw) > cfg.max_schema_bytes:
                raise limit_error(
                    "max_schema_bytes", f"schema is {len(raw)} bytes, more than {cfg.max_schema_bytes}"
                )
            _validate_grammar("json_schema", raw, "response_format.json_schema.schema")
    elif kind == "regex":
        regex = fmt.get("regex", fmt.get("pattern"))
        if not isinstance(regex, str) or not regex:
            raise ApiError(
                400, "response_format regex must be a non-empty string", param="response_format.regex"
            )
        if len(regex) > cfg.max_regex_chars:
            raise limit_error("max_regex_chars", f"regex of {len(regex)} chars exceeds {cfg.max_regex_chars}")
        _validate_grammar("regex", regex, "response_format.regex")


def _validate_grammar(kind: Literal["json_schema", "regex"], source: str, param: str) -> None:
    """llguidance's own parser (no tokenizer needed): the engine compiles the same text."""
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, source))
    except (ValueError, TypeError, RuntimeError) as exc:
        problem = str(exc)
    if problem:
        first = problem.strip().splitlines()[0] if problem.strip() else problem
        raise ApiError(400, f"invalid {kind.replace('_', ' ')}: {first}", param=param)


def walk(body: dict[str, Any]) -> BodyFacts:
    """One iterative pass: image references by protocol shape, and total text characters."""
    facts = BodyFacts()
    stack: list[tuple[str, Any]] = [("", body)]
    nodes = 0
    while stack:
        path, node = stack.pop()
        nodes += 1
        if nodes > MAX_JSON_NODES:
            raise ApiError(400, "request body has too many JSON values", param="body")
        if isinstance(node, str):
            facts.text_chars += len(node)
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
        elif isinstance(node, dict):
            ref = _image_ref(node)
            if ref is not None:
                facts.images.append((path or "body", ref))
                continue
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
    facts.images.reverse()
    return facts


def _image_ref(node: dict[str, Any]) -> str | None:
    kind = node.get("type")
    if kind == "image_url":  # Chat Completions
        inner = node.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
        return url if isinstance(url, str) else ""
    if kind == "input_image":  # Responses
        url = node.get("image_url")
        return url if isinstance(url, str) else ""
    if kind == "image":  # Anthropic Messages
        src = node.get("source")
        if isinstance(src, dict) and src.get("type") == "base64":
            media = src.get("media_type", "image/png")
            return f"data:{media};base64,{src.get('data', '')}"
        if isinstance(src, dict) and src.get("type") == "url":
            return str(src.get("url", ""))
        return ""
    return None


def check_images(
    facts: BodyFacts, cfg: ApiConfig, cache: PreprocessCache | None = None
) -> list[tuple[int, int]]:
    """Count, media type, bytes, header canvas and framing of every image, without decoding
    any; remote URLs by policy (fetched later, by ``images.resolve_images``). Returns the
    declared sizes of the data-URL images. ``cache``: the server's preprocessing cache, which
    remembers data URLs that passed (a re-sent image is not decoded again)."""
    limits = image_limits(cfg)
    if len(facts.images) > cfg.max_images:
        raise limit_error("max_images", f"{len(facts.images)} images, more than {cfg.max_images}")
    sizes = []
    for where, ref in facts.images:
        header = check_image_ref(ref, limits, where, cache)
        if header is not None:
            sizes.append((header.width, header.height))
    return sizes


def image_limits(cfg: ApiConfig) -> ImageLimits:
    return ImageLimits(
        cfg.max_images, cfg.max_image_bytes, cfg.max_image_pixels, cfg.max_image_side_px,
        cfg.allow_remote_images, cfg.image_url_allow_hosts,
    )  # fmt: skip


def check_body(
    body: dict[str, Any], kind: str, cfg: ApiConfig, image_cache: PreprocessCache | None = None
) -> BodyFacts:
    """All pre-conversion checks for one request; returns what the walk found."""
    check_generation(body, kind, cfg)
    check_tools_and_formats(body, cfg)
    facts = walk(body)
    if facts.text_chars > cfg.max_prompt_chars:
        raise limit_error(
            "max_prompt_chars", f"request text is {facts.text_chars} chars, more than {cfg.max_prompt_chars}"
        )
    check_images(facts, cfg, image_cache)
    return facts
