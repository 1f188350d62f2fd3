"""``ApiConfig``: every limit a client can run into, in one frozen, validated dataclass.

Defaults are chosen for the embedded deployment (one CPU process, the small trained checkpoint) and
documented in docs/api.md; each field's comment says what exceeding it returns. The
context limit is a fact of the served model, so it comes from the engine's ``ModelInfo``
unless ``context_limit`` overrides it (``resolve`` settles it into a new config).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from services.api.traffic_class import parse_api_keys

# Names clients may send as ``model``. Each maps to the DeepSeek V4.1-Flash prompt format;
# ``deepseek-chat`` defaults to non-thinking and ``deepseek-reasoner`` to thinking, as on
# DeepSeek's own API; every other name uses recipe's default (thinking on).
DEFAULT_ALIASES: tuple[str, ...] = ("deepseek-chat", "deepseek-reasoner", "DeepSeek-V4.1-Flash")
NON_THINKING_ALIASES: tuple[str, ...] = ("deepseek-chat",)


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # -- models --
    served_model_name: str = ""  # "" = the engine's model id (the checkpoint's directory name)
    model_aliases: tuple[str, ...] = DEFAULT_ALIASES
    non_thinking_aliases: tuple[str, ...] = NON_THINKING_ALIASES
    # -- HTTP framing (413 / 431) --
    max_body_bytes: int = 8 * 2**20
    max_header_bytes: int = 16 * 2**10  # all request headers, names and values; 431 beyond
    # -- generation (400) --
    context_limit: int = 0  # 0 = the model's max_position_embeddings
    max_tokens_limit: int = 4096  # largest accepted max_tokens / max_output_tokens
    default_max_tokens: int = 256  # when the request sets none (recipe's 8192/65536 are for V4.1 on GPUs)
    max_prompt_chars: int = 1 * 2**20  # raw prompt text, checked before tokenising
    max_n: int = 1  # recipe supports n == 1 only; kept as an explicit bound
    max_top_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_chars: int = 256
    # -- tools and structured output (400) --
    max_tools: int = 64
    max_tools_bytes: int = 256 * 2**10  # JSON of the whole tools array
    max_schema_bytes: int = 64 * 2**10  # response_format / text.format JSON schema
    max_regex_chars: int = 4096
    # -- images (400) --
    max_images: int = 8
    max_image_bytes: int = 4 * 2**20  # one encoded image
    max_image_pixels: int = 16 * 2**20  # width * height from the image header (bomb guard)
    max_image_side_px: int = 8192
    allow_remote_images: bool = False
    image_url_allow_hosts: tuple[str, ...] = ()  # exact host names; empty = none even if allowed
    # recipe's preprocessed images kept by (original bytes, detail): a conversation re-sends
    # its images every turn; a hit skips the decode and resize (0 = off)
    image_cache_bytes: int = 64 * 2**20
    # -- admission (429) --
    max_concurrency: int = 8  # requests generating at once
    max_queue: int = 16  # requests waiting for a slot; beyond it 429 at once
    queue_timeout_s: float = 10.0  # a queued request waits at most this long, then 429
    retry_after_s: int = 1
    # -- time --
    request_timeout_s: float = 600.0  # wall clock for one generation
    # -- auth --
    # entries "KEY" or "KEY:CLASS" (CLASS: the key's traffic class, agent or chat; see
    # services/api/traffic_class.py); a key's class beats the X-Sluice-Traffic-Class header
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: Path | None = None
    # keys of the operator endpoints under /admin (draining engines); none: those are off.
    # Distinct from api_keys: a client's key never drains an engine
    admin_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        positive = (
            "max_body_bytes", "max_header_bytes", "max_tokens_limit", "default_max_tokens",
            "max_prompt_chars", "max_n", "max_stop_chars", "max_tools_bytes", "max_schema_bytes",
            "max_regex_chars", "max_image_bytes", "max_image_pixels", "max_image_side_px",
            "max_concurrency", "retry_after_s",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ApiConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_top_logprobs", "max_stop_sequences", "max_tools", "max_images", "max_queue", "image_cache_bytes",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"ApiConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_top_logprobs > 20:
            raise ValueError("ApiConfig.max_top_logprobs must be <= 20 (the protocols' own bound)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ApiConfig.port must be in [0, 65535], got {self.port}")
        if self.context_limit < 0:
            raise ValueError("ApiConfig.context_limit must be >= 0 (0 = the model's context)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("ApiConfig.default_max_tokens must be <= max_tokens_limit")
        if self.queue_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("ApiConfig.queue_timeout_s and request_timeout_s must be > 0")
        if any(not k for k in self.api_keys):
            raise ValueError("ApiConfig.api_keys must not contain empty keys")
        if any(not k or ":" in k for k in self.admin_keys):
            raise ValueError(
                "ApiConfig.admin_keys must be non-empty keys without ':' (admin keys have no traffic class)"
            )
        try:
            parse_api_keys(self.api_keys)
        except ValueError as exc:
            raise ValueError(f"ApiConfig.api_keys: {exc}") from None
        for host in self.image_url_allow_hosts:
            _reject_ip_literal(host)

    def resolve(self, model_id: str, model_context: int) -> ApiConfig:
        """Settle the model-dependent defaults and read the key file; returns a new config."""
        keys = self.api_keys
        if self.api_keys_file is not None:
            keys = keys + load_key_file(self.api_keys_file)
        return replace(
            self,
            served_model_name=self.served_model_name or model_id,
            context_limit=self.context_limit or model_context,
            api_keys=keys,
            api_keys_file=None,
        )

    @property
    def model_names(self) -> tuple[str, ...]:
        names = (
            (self.served_model_name, *self.model_aliases) if self.served_model_name else self.model_aliases
        )
        return tuple(dict.fromkeys(names))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def load_key_file(path: Path) -> tuple[str, ...]:
    """One key per line (``KEY`` or ``KEY:CLASS``); blank lines and ``#`` comments ignored."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from exc
    keys = tuple(ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"API key file {path} holds no keys")
    return keys


def _reject_ip_literal(host: str) -> None:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return
    raise ValueError(
        f"image_url_allow_hosts takes host names, not IP literals ({host!r}); addresses are "
        "checked after resolution and private/loopback ones are always refused"
    )
