"""``SamplingParams``: what a request asks of the sampler (pure, validated, frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MAX_N = 16  # bounded: unbounded n is an advisory class (CVE-2026-34756)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of ``json_schema`` (JSON text), ``regex`` or ``grammar`` (Lark-style EBNF)."""

    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutput needs exactly one of json_schema, regex, grammar; got {given}"
            )

    @property
    def kind(self) -> str:
        return (
            "json_schema"
            if self.json_schema is not None
            else "regex"
            if self.regex is not None
            else "grammar"
        )

    @property
    def source(self) -> str:
        return self.json_schema or self.regex or self.grammar or ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy (argmax, lowest id on ties)."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens (vLLM/CTRL definition)
    presence_penalty: float = 0.0  # over output tokens (OpenAI definition)
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # control tokens (every added token) stay out of the text
    logprobs: int | None = None  # number of top logprobs per sampled token (0: just the token's)
    structured: StructuredOutput | None = field(default=None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:  # noqa: C901 - a flat list of independent checks
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop
        ):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_STRING_CHARS} chars"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError("n > 1 with temperature 0 would return n identical greedy completions")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int, base_seed: int) -> SamplingParams:
        """The params of completion ``index`` of ``n``: n=1 and its own derived seed."""
        return replace(self, n=1, seed=derive_seed(base_seed, f"child:{index}"))


def derive_seed(base: int, label: str) -> int:
    """A 63-bit seed from a base seed and a label, identical in every process."""
    import hashlib

    digest = hashlib.sha256(f"{base}:{label}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
