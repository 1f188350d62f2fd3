"""The one registry of environment variables Sluice reads.

Every variable has the ``SLUICE_`` prefix, a typed parser and a default. Nothing else in
the code base calls ``os.getenv``: components receive settled values through their
configs. A malformed value raises ``ValueError`` naming the variable and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")
PREFIX = "SLUICE_"


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_int(raw: str) -> int:
    return int(raw.strip())


def _parse_float(raw: str) -> float:
    return float(raw.strip())


def _parse_path(raw: str) -> Path:
    return Path(raw).expanduser()


def _parse_optional_path(raw: str) -> Path | None:
    return Path(raw).expanduser() if raw.strip() else None


def _parse_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r} is invalid: {exc}. {self.help}") from exc


REGISTRY: dict[str, EnvVar[Any]] = {}


def _register(name: str, parse: Callable[[str], T], default: T, help: str) -> EnvVar[T]:
    if not name.startswith(PREFIX):
        raise ValueError(f"environment variable {name} must start with {PREFIX}")
    var = EnvVar(name, parse, default, help)
    REGISTRY[name] = var
    return var


HOME = _register(
    "SLUICE_HOME", _parse_path, Path("var"), "Directory for generated checkpoints, data and logs."
)
MODEL_DIR: EnvVar[Path | None] = _register(
    "SLUICE_MODEL_DIR",
    _parse_optional_path,
    None,
    "Checkpoint directory; unset means the shipped trained preset (models/trained).",
)
HOST = _register("SLUICE_HOST", str, "127.0.0.1", "Address the API server binds to.")
PORT = _register("SLUICE_PORT", _parse_int, 8000, "Port the API server listens on.")
API_KEYS: EnvVar[tuple[str, ...]] = _register(
    "SLUICE_API_KEYS",
    _parse_list,
    (),
    "Comma-separated API keys, each KEY or KEY:CLASS (agent|chat); empty disables auth.",
)
API_KEYS_FILE: EnvVar[Path | None] = _register(
    "SLUICE_API_KEYS_FILE", _parse_optional_path, None, "File with one API key (KEY or KEY:CLASS) per line."
)
ADMIN_KEYS: EnvVar[tuple[str, ...]] = _register(
    "SLUICE_ADMIN_KEYS",
    _parse_list,
    (),
    "Comma-separated keys of the operator endpoints under /admin (draining engines); empty turns them off.",
)
REDIS_URL = _register("SLUICE_REDIS_URL", str, "", "Redis URL for store metadata; empty means in-process.")
LOG_LEVEL = _register("SLUICE_LOG_LEVEL", str, "INFO", "Python logging level name.")
DEVICE = _register("SLUICE_DEVICE", str, "auto", "Engine device: auto, cpu or cuda[:N].")
DETERMINISTIC = _register(
    "SLUICE_DETERMINISTIC", _parse_bool, True, "Batch-invariant kernels and deterministic sampling."
)


def describe() -> str:
    """One line per variable, for ``sluice env``."""
    lines = []
    for var in REGISTRY.values():
        lines.append(f"{var.name:<24} default={var.default!s:<12} {var.help}")
    return "\n".join(lines)


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse every registered variable once; raises on the first malformed one."""
    return {name: var.get(environ) for name, var in REGISTRY.items()}


def foreign(name: str) -> str | None:
    """A variable another library reads (e.g. gloo's ``GLOO_SOCKET_IFNAME``), so that an
    operator's own setting is respected rather than overwritten; None when unset."""
    if name.startswith(PREFIX):
        raise ValueError(f"{name} is Sluice's own: read it through its registered EnvVar")
    return os.environ.get(name)


def export_to_children(values: Mapping[str, str]) -> None:
    """Set variables that child processes we start (Ray's raylet, workers) must inherit."""
    os.environ.update(values)
