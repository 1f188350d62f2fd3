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


class DisaggregatedGenerator:
    """``prefill`` / ``decode``: handles of ``EngineActor``s (``actors.remote_engine_actor``)."""

    def __init__(self, prefill: Any, decode: Any, timeout_s: float | None = 120.0) -> None:
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s

    def start(
        self, request_id: str, prompt_token_ids: list[int], sampling: Mapping[str, Any]
    ) -> tuple[Any, Any]:
        """Submit the prefill; returns (info ref, handoff ref)."""
        return self.prefill.prefill.options(num_returns=2).remote(
            request_id, [int(t) for t in prompt_token_ids], dict(sampling)
        )

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Mapping[str, Any]
    ) -> DisaggResult:
        import ray

        info_ref, handoff_ref = self.start(request_id, prompt_token_ids, sampling)
        info = ray.get(info_ref, timeout=self.timeout_s)
        tokens = list(info["tokens"])
        result = DisaggResult(
            request_id, tokens, info["finish_reason"], info["first_token"], len(tokens), False, info
        )
        if info["finish_reason"] is not None:
            return result
        try:
            out = ray.get(self.decode.resume.remote(handoff_ref), timeout=self.timeout_s)
        except BaseException:
            self._abort_decode(request_id)
            raise
        if out["request_id"] != request_id:  # the payload names its own request: a mix-up is a bug
            self._abort_decode(out["request_id"])
            raise RuntimeError(f"decode actor resumed {out['request_id']!r}, expected {request_id!r}")
        result.tokens += out["tokens"]
        result.finish_reason, result.handed_off = out["finish_reason"], True
        return result

    def _abort_decode(self, request_id: str) -> None:
        import ray

        with contextlib.suppress(Exception):  # best effort: the original error is what the caller sees
            ray.get(self.decode.abort.remote(request_id), timeout=self.timeout_s)
