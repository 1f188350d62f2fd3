"""The API server's view of an engine: an async client, whatever stands behind it.

The same server fronts the in-process engine (``InProcessEngineClient``), and later the
router with its disaggregated prefill/decode pools: each implements ``EngineClient``.
The server never touches engine internals; it sends token ids and sampling settings and
receives token ids, logprobs, a finish reason and usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from kvstore.shardfmt import TRAFFIC_CLASSES

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineRequestError(ValueError):
    """The engine refused the request as given (e.g. a grammar it cannot compile): a 400."""


class EngineUnavailable(RuntimeError):
    """The engine is not running or died: a 503."""


class HandoffLost(EngineUnavailable):
    """A disaggregated request's handoff payload could not be had by its decode engine (its
    holder died, dropped or evicted it, or the link failed): it is prefilled again."""


class EngineBusy(EngineUnavailable):
    """The engines are up but none has room for the request now (backpressure): a 503 with
    Retry-After. Nothing is held for the request; a router does not count it against the
    engine it chose."""


@dataclass(frozen=True)
class StructuredSpec:
    """At most one output constraint: ``kind`` is json_schema, regex or grammar (Lark)."""

    kind: Literal["json_schema", "regex", "grammar"]
    source: str  # "" with kind json_schema means any JSON value


SWA_REPLAY_MODES = (None, "exact", "bounded")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    stop_token_ids: tuple[int, ...] = ()  # added to the model's EOS ids
    ignore_eos: bool = False  # the model's EOS does not end the request (stop_token_ids still do)
    structured: StructuredSpec | None = None
    priority: int = 0
    # The KV store's TTL class for every block this request writes ("agent" or "chat"; the
    # API takes it from the API key, else the X-Sluice-Traffic-Class header, else "chat").
    traffic_class: str = "chat"
    # A prefix hit whose sliding-window state is gone: "exact" or "bounded" replay (approximate,
    # cheaper); None: the engine's default.
    swa_replay: str | None = None
    # The prompt's images (engine.vision.stage.ImagePart: span of placeholder tokens and the
    # recipe's preprocessed image), in order; the engine client encodes them
    images: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("EngineRequest: the prompt is empty")
        if self.swa_replay not in SWA_REPLAY_MODES:
            raise ValueError(
                f"EngineRequest: swa_replay must be 'exact', 'bounded' or None, got {self.swa_replay!r}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"EngineRequest: max_tokens must be >= 1, got {self.max_tokens}")
        if self.traffic_class not in TRAFFIC_CLASSES:
            raise ValueError(
                f"EngineRequest: traffic_class must be one of {', '.join(sorted(TRAFFIC_CLASSES))}, "
                f"got {self.traffic_class!r}"
            )


# One sampled token's logprob and its top alternatives: (logprob, [(token_id, logprob), ...]).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class EngineOutput:
    """One incremental update of one request.

    ``token_ids`` are the tokens new since the previous update (possibly none on the
    final one); a terminating stop token (EOS or a ``stop_token_ids`` entry) is left
    out, since it is not text, but it is counted in ``completion_tokens``. ``finish_reason`` is set exactly once, on the last update. Usage counts
    are cumulative and always filled: ``prompt_tokens`` (as the engine counted them),
    ``cached_tokens`` (prompt tokens served from the prefix cache, i.e. not recomputed),
    ``completion_tokens`` (all tokens generated so far). ``bounded_replay``: the request's
    state came from a bounded replay of a prefix hit, so its output is approximate.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    bounded_replay: bool = False


@dataclass(frozen=True)
class EngineStats:
    """Counters a test or the metrics endpoint can read. Block counts are KV-cache blocks."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    requests_total: int
    aborted_total: int
    finished_total: int
    steps: int
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    context_limit: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_path: str
    # A prefix hit without its sliding-window state recomputes this many tokens: (exact
    # replay, bounded replay); and the replay requests get when they do not choose.
    swa_replay_tokens: tuple[int, int] = (0, 0)
    swa_replay_default: str = "exact"
    vision: bool = False  # the checkpoint has a vision encoder: requests may carry images
    vision_fingerprint: str = ""  # its identity (engine.model.vision.vision_fingerprint): image keys
    # With SWA slot sharing (after ``start``): this replica's slot server, as it names itself
    # in the SWA directory ("host:port"; None: no sharing), the directory's URL, and whether
    # its host slots are exact state (False: lossy, e.g. MXFP8; they serve only requests
    # that accept bounded replay).
    swa_holder: str | None = None
    swa_directory: str | None = None
    swa_slot_exact: bool = True
    # tokens a hit on one of its host slots still replays (bounded) to rebuild the layers the
    # slot does not keep (EngineConfig.host_swa_layers); 0 when a slot keeps every layer
    swa_slot_replay: int = 0


@runtime_checkable
class EngineClient(Protocol):
    """Async access to an engine. All methods are safe to call from one event loop.

    - ``generate`` submits the request and yields its ``EngineOutput``s in order; the last
      one has ``finish_reason`` set. It raises ``EngineRequestError`` (before yielding
      anything) when the engine refuses the request, and ``EngineUnavailable`` when the
      engine is not running or dies mid-request. If the consumer stops iterating early
      (``aclose``, cancellation: the client disconnected), the request is aborted in the
      engine and its KV blocks are freed; callers need not call ``abort`` themselves.
    - ``abort`` stops a request by id; idempotent, a no-op for unknown ids.
    - ``ready`` probes the engine (it answers within ``timeout_s``); never raises.
    - ``stats`` is a snapshot of counters; cheap, no engine round trip needed.
    - ``model_info`` describes the served model; constant for the client's lifetime.
    - ``start`` / ``close`` bracket the client's lifetime (the app's lifespan calls them).
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def ready(self, timeout_s: float = 5.0) -> bool: ...

    def stats(self) -> EngineStats: ...

    def model_info(self) -> ModelInfo: ...


@runtime_checkable
class EnginePools(Protocol):
    """An engine client over named engines that an operator can drain one by one (the Ray
    deployment's pools). ``engines`` reads this process's pushed view (no engine round trip);
    ``set_draining`` raises ``KeyError`` for an unknown name."""

    def engines(self) -> list[dict[str, Any]]: ...

    async def set_draining(self, engine: str, draining: bool) -> dict[str, Any]: ...
