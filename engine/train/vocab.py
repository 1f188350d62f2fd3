"""Cut the DeepSeek V4 vocabulary to the tokens the training corpus uses most.

The cut keeps, renumbered densely:

* the same special tokens as the project's random-preset cut
  (``engine.checkpoint.tokenizer``): BOS, EOS, pad at ids 0, 1, 2, every token
  deepseek-recipe's encodings can emit (with ``<｜System｜>``) and V4's named chat,
  tool-call, FIM and grounding tokens;
* the 256-character byte-level alphabet, so every byte string is representable and
  ``decode(encode(text)) == text`` for any text (the V4 tokenizer has no normalizer);
* then V4 BPE tokens by descending frequency when the *training split* is tokenised with
  the full V4 vocabulary (ties by V4 id), each with the tokens its merge is built from
  (recursively), until the target size. A corpus too small to fill the target is topped
  up with V4's earliest merges, as the random-preset cut does.

The merges kept are V4's merges whose two parts and result are all kept, in V4's order, so
the result is valid byte-level BPE and tokenises any text. Regular tokens are numbered in
V4 id order. Everything is a pure function of the training texts and the target size, so
the same corpus gives the same ``tokenizer.json`` bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from engine.checkpoint.tokenizer import (
    SYSTEM_TOKEN,
    _add_system_token,
    _base_tokenizer,
    _is_named_special,
    recipe_special_tokens,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
_BATCH = 64


def base_tokenizer_json() -> dict[str, Any]:
    """The full V4 tokenizer, with ``<｜System｜>`` in its placeholder slot."""
    tok = _base_tokenizer()
    _add_system_token(tok)
    return tok


def tokenizer_from_json(tok: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(tok, ensure_ascii=False))


def encode_texts(
    tok: Tokenizer, texts: Sequence[str], progress: Callable[[int, int], None] | None = None
) -> list[list[int]]:
    """Token ids of each text (no special tokens added), in batches."""
    out: list[list[int]] = []
    for start in range(0, len(texts), _BATCH):
        encs = tok.encode_batch(list(texts[start : start + _BATCH]), add_special_tokens=False)
        out.extend(e.ids for e in encs)
        if progress is not None:
            progress(min(start + _BATCH, len(texts)), len(texts))
    return out


def token_counts(
    tok: Tokenizer, texts: Sequence[str], progress: Callable[[int, int], None] | None = None
) -> np.ndarray:
    counts = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for ids in encode_texts(tok, texts, progress):
        if ids:
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(counts))
    return counts


def _special_entries(tok: dict[str, Any]) -> list[dict[str, Any]]:
    wanted = set(recipe_special_tokens())
    return [
        t
        for t in sorted(tok["added_tokens"], key=lambda t: t["id"])
        if t["id"] <= 2 or t["content"] in wanted or _is_named_special(t["id"])
    ]


def _closure(token: str, kept: set[str], parents: dict[str, tuple[str, str]]) -> list[str]:
    """``token`` and the not-yet-kept tokens it is merged from, parents first."""
    order: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, bool]] = [(token, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if t in kept or t in seen:
            continue
        seen.add(t)
        stack.append((t, True))
        if t not in parents:
            raise ValueError(f"token {t!r} has no merge and is not a byte")
        left, right = parents[t]
        stack.append((right, False))
        stack.append((left, False))
    return order


def _select(
    base: dict[str, Any], counts: np.ndarray, n_regular: int, merges: list[list[str]], exclude: set[str]
) -> set[str]:
    """The regular tokens to keep: bytes, then by corpus frequency with their parts, then top-up."""
    vocab: dict[str, int] = base["model"]["vocab"]
    alphabet = set(ByteLevel.alphabet())
    kept: set[str] = {t for t in vocab if t in alphabet}
    if len(kept) != len(alphabet):
        raise ValueError("the base vocabulary lacks part of the byte-level alphabet")
    id_to_token = {i: t for t, i in vocab.items()}
    parents: dict[str, tuple[str, str]] = {}
    for left, right in merges:
        parents.setdefault(left + right, (left, right))
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id
    for idx in order:
        if counts[idx] <= 0 or len(kept) >= n_regular:
            break
        token = id_to_token.get(int(idx))
        if token is None or token in exclude or token in kept:
            continue
        need = _closure(token, kept, parents)
        if len(kept) + len(need) <= n_regular:
            kept.update(need)
    for left, right in merges:  # top up from the earliest merges
        if len(kept) >= n_regular:
            break
        if left in kept and right in kept and left + right not in kept and left + right not in exclude:
            kept.add(left + right)
    return kept


def cut_vocabulary(base: dict[str, Any], counts: np.ndarray, vocab_size: int) -> dict[str, Any]:
    """The tokenizer JSON of ``base`` cut to ``vocab_size`` ids by ``counts`` (indexed by base id)."""
    specials = _special_entries(base)
    n_regular = vocab_size - len(specials)
    if n_regular < 256:
        raise ValueError(f"vocab_size {vocab_size} too small: {len(specials)} specials + 256 bytes need room")
    exclude = {t["content"] for t in base["added_tokens"]}
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in base["model"]["merges"]]
    kept = _select(base, counts, n_regular, merges, exclude)
    vocab: dict[str, int] = base["model"]["vocab"]
    out = copy.deepcopy(base)
    new_vocab: dict[str, int] = {}
    for entry in specials[:3]:  # bos, eos, pad keep ids 0..2
        new_vocab[entry["content"]] = len(new_vocab)
    for token in sorted(kept, key=lambda t: vocab[t]):
        new_vocab.setdefault(token, len(new_vocab))
    added = []
    for entry in specials:
        if entry["content"] not in new_vocab:
            new_vocab[entry["content"]] = len(new_vocab)
        added.append({**entry, "id": new_vocab[entry["content"]]})
    out["model"]["vocab"] = new_vocab
    out["model"]["merges"] = [f"{a} {b}" for a, b in merges if a in kept and b in kept and a + b in kept]
    out["added_tokens"] = added
    if len(new_vocab) != vocab_size:
        raise ValueError(f"cut has {len(new_vocab)} ids, wanted {vocab_size}")
    return out


def write_tokenizer_json(tok: dict[str, Any], out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (as the checkpoint generator does)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    contents = {t["content"] for t in tok["added_tokens"]}
    missing = [s for s in recipe_special_tokens() if s not in contents]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens the recipe emits: {missing}")
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
    )


def special_ids(tok: dict[str, Any]) -> dict[str, int]:
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    return {"bos": ids[BOS], "eos": ids[EOS], "pad": ids[EOS], "system": ids[SYSTEM_TOKEN]}
