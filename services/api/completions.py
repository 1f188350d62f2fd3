"""Legacy ``/v1/completions``: raw prompt in, ``text_completion`` objects out.

recipe has no Completions type, so the request is checked here (a handful of fields) and
the output runs through recipe's Chat Completions stream processor with thinking and
tool-call parsing off, which decodes tokens, applies stop sequences and counts usage;
``to_completion`` rewrites each chat chunk or response into the Completions shape.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import deepseek_recipe as dr

from services.api.errors import ApiError

if TYPE_CHECKING:
    from services.api.convert import Converter, Prepared

_UNSUPPORTED = {"echo": False, "suffix": None, "best_of": 1}
_NUMBER = (int, float)


def _prompt_ids(conv: Converter, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        ids = conv.tokenizer.encode(prompt)
        return ids if ids[:1] == [conv.bos_id] else [conv.bos_id, *ids]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = conv.info.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")


def _check_fields(body: dict[str, Any]) -> None:
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model is required and must be a string", param="model")
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name, allowed) not in (allowed, None):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, _NUMBER) or not lo <= value <= hi:
            raise ApiError(400, f"{name} must be a number in [{lo}, {hi}]", param=name)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, "seed must be an integer in [0, 2^63)", param="seed")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop))
    ):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", param="stop")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    if not isinstance(body.get("ignore_eos", False), bool):
        raise ApiError(400, "ignore_eos must be a boolean", param="ignore_eos")


def prepare_completion(
    conv: Converter, raw: bytes, body: dict[str, Any], traffic_class: str = "chat"
) -> Prepared:
    from services.api.convert import Prepared

    _check_fields(body)
    model = body["model"]
    if model not in conv.cfg.model_names:
        names = ", ".join(conv.cfg.model_names)
        raise ApiError(
            400, f"The supported API model names are {names}, but you passed {model}.", param="model"
        )
    prompt_ids = _prompt_ids(conv, body.get("prompt"))
    requested = body.get("max_tokens")
    conv.check_context(len(prompt_ids), requested)
    limit = conv.cfg.context_limit
    max_tokens = (
        requested
        if requested is not None
        else max(1, min(conv.cfg.default_max_tokens, limit - len(prompt_ids)))
    )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    conversation = dr.Conversation([dr.UserMessage("")], thinking_mode=False)
    creq = dr.ConversationRequest(conversation, dr.ModelVersion.DeepseekV41Flash)
    options = dr.ParsingOptions(parse_tool_calls=False, thinking_initial_stage=None, stop_sequences=stops)
    rid = f"cmpl-{uuid.uuid4().hex}"
    logprobs = body.get("logprobs")
    from services.api.engine_client import EngineRequest

    engine_req = EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=int(max_tokens),
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)) or 1.0,
        seed=body.get("seed"),
        top_logprobs=logprobs if isinstance(logprobs, int) else None,
        ignore_eos=bool(body.get("ignore_eos", False)),  # vLLM's extension: fixed-length outputs
        traffic_class=traffic_class,
        swa_replay=body.get("swa_replay"),
    )
    return Prepared(
        "completions", rid, model, bool(body.get("stream", False)), prompt_ids, engine_req,
        lambda: dr.ChatCompletionRequest.chunk_generator(creq, rid, model), options,
        hidden_ids=conv.hidden_ids(body, options),
    )  # fmt: skip


def _legacy_logprobs(lp: Any) -> dict[str, Any] | None:
    if not isinstance(lp, dict) or not lp.get("content"):
        return None
    items = lp["content"]
    return {
        "tokens": [it["token"] for it in items],
        "token_logprobs": [it["logprob"] for it in items],
        "top_logprobs": [{t["token"]: t["logprob"] for t in it.get("top_logprobs") or []} for it in items],
        "text_offset": [],
    }


def to_completion(chat: dict[str, Any], chunk: bool) -> dict[str, Any]:
    """A Chat Completions chunk or response (as parsed JSON) in the Completions shape."""
    choices = []
    for ch in chat.get("choices", []):
        part = ch.get("delta" if chunk else "message") or {}
        choices.append(
            {
                "index": ch.get("index", 0),
                "text": part.get("content") or "",
                "logprobs": _legacy_logprobs(ch.get("logprobs")),
                "finish_reason": ch.get("finish_reason"),
            }
        )
    out: dict[str, Any] = {
        "id": chat["id"],
        "object": "text_completion",
        "created": chat["created"],
        "model": chat["model"],
        "choices": choices,
    }
    if chat.get("usage") is not None:
        out["usage"] = chat["usage"]
    return out


def completion_json(chat_json: str, chunk: bool) -> str:
    return json.dumps(to_completion(json.loads(chat_json), chunk))
