"""``DisaggregatedGenerator``: one request through a prefill actor, then a decode actor.

The prefill actor runs the prompt and samples the first token; its call has two returns,
the info dict (fetched by the driver) and the handoff bytes (never fetched by the driver:
its ObjectRef is passed to the decode actor, which Ray resolves to the bytes there). The
decode actor imports the sequence and decodes it to its end. If anything fails after the
prefill, the request is aborted on the decode actor so that nothing stays held there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DisaggResult:
    request_id: str
    tokens: list[int]  # every output token: the prefill side's, then the decode side's
    finish_reason: str | None
    first_token: int | None
    prefill_tokens: int  # how many of ``tokens`` came from the prefill actor
    handed_off: bool  # False when the request ended on the prefill actor
    info: dict[str, Any] = field(default_factory=dict)  # the prefill actor's info dict


def run_prefill(
    prefill: Any,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: Mapping[str, Any],
    timeout_s: float | None,
    result_type: type[DisaggResult] = DisaggResult,
) -> tuple[DisaggResult, Any]:
    """Run the prefill; returns (the result so far, the handoff bytes' ObjectRef, never fetched)."""
    import ray

    info_ref, handoff_ref = prefill.prefill.options(num_returns=2).remote(
        request_id, [int(t) for t in prompt_token_ids], dict(sampling)
    )
    info = ray.get(info_ref, timeout=timeout_s)
    tokens = list(info["tokens"])
    result = result_type(
        request_id, tokens, info["finish_reason"], info["first_token"], len(tokens), False, info
    )
    return result, handoff_ref


def resume_on(decode: Any, request_id: str, handoff_ref: Any, timeout_s: float | None) -> dict[str, Any]:
    """Resume the handed-off sequence on ``decode`` to its end; on any failure abort it there."""
    import ray

    try:
        out = ray.get(decode.resume.remote(handoff_ref), timeout=timeout_s)
    except BaseException:
        abort_on(decode, request_id, timeout_s)
        raise
    if out["request_id"] != request_id:  # the payload names its own request: a mix-up is a bug
        abort_on(decode, out["request_id"], timeout_s)
        abort_on(decode, request_id, timeout_s)
        raise RuntimeError(f"decode actor resumed {out['request_id']!r}, expected {request_id!r}")
    return out


def abort_on(actor: Any, request_id: str, timeout_s: float | None) -> None:
    import ray

    with contextlib.suppress(Exception):  # best effort: the original error is what the caller sees
        ray.get(actor.abort.remote(request_id), timeout=timeout_s)


class DisaggregatedGenerator:
    """``prefill`` / ``decode``: handles of ``EngineActor``s (``actors.remote_engine_actor``)."""

    def __init__(self, prefill: Any, decode: Any, timeout_s: float | None = 120.0) -> None:
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Mapping[str, Any]
    ) -> DisaggResult:
        result, handoff_ref = run_prefill(
            self.prefill, request_id, prompt_token_ids, sampling, self.timeout_s
        )
        if result.finish_reason is not None:
            return result
        out = resume_on(self.decode, request_id, handoff_ref, self.timeout_s)
        result.tokens += out["tokens"]
        result.finish_reason, result.handed_off = out["finish_reason"], True
        return result
