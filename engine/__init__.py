"""Sluice engine. ``from engine import LLM, SamplingParams`` (imported lazily: importing
``engine`` alone pulls in neither torch nor the model)."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "StructuredOutput"):
        from engine.sampling import params

        return getattr(params, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
