"""The cut vocabulary: loads in both tokenizers, round-trips, keeps recipe's tokens, is deterministic."""

from __future__ import annotations

import hashlib
import json

import deepseek_recipe as dr
from tokenizers import Tokenizer

from engine.checkpoint.tokenizer import SYSTEM_TOKEN, recipe_special_tokens
from engine.train import vocab
from engine.train.corpus import load_corpus, split
from engine.train.data import Progress, build_data


def test_loads_and_round_trips_heldout_and_odd_text(built, subset_tree):
    tok = Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    c = load_corpus(subset_tree)
    s = split(c.manifest)
    odd = "tab\tcr\r\nnul\x00 \u00e9\u4e2d\u6587 \U0001f600 \ufeff<｜User｜ \\x"
    for text in [c.texts[i] for i in s.heldout] + [odd]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert max(ids) < 1024
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_keeps_recipe_tokens_and_renders_a_chat(built):
    path = str(built / "tokenizer.json")
    hf = Tokenizer.from_file(path)
    for special in recipe_special_tokens():
        assert len(hf.encode(special, add_special_tokens=False).ids) == 1, special
    header = json.loads((built / "data.json").read_text())
    assert header["tokenizer"]["bos"] == 0 and header["tokenizer"]["eos"] == 1
    assert hf.token_to_id(SYSTEM_TOKEN) == header["tokenizer"]["system"]
    conv = dr.Conversation(
        [dr.SystemMessage("Be terse."), dr.UserMessage("What is 2+2?"), dr.AssistantMessage("4")],
        thinking_mode=True,
    )
    enc = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(path))
    prompt = enc.render_conversation(conv).prompt
    ids = enc.encode(conv)
    assert max(ids) < 1024
    assert hf.decode(ids, skip_special_tokens=False) == prompt
    assert hf.token_to_id("<｜User｜>") in ids


def test_same_corpus_same_tokenizer_bytes(built, subset_tree, tmp_path):
    import io

    build_data(
        tmp_path, root=subset_tree, vocab_size=1024, measure_sizes=(), progress=Progress(io.StringIO())
    )
    for name in ("tokenizer.json", "train.bin", "heldout.bin", "manifest.json", "split.json"):
        a = hashlib.sha256((built / name).read_bytes()).hexdigest()
        b = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert a == b, name


def test_cut_prefers_corpus_tokens_and_stays_valid_bpe():
    import numpy as np

    base = vocab.base_tokenizer_json()
    full = vocab.tokenizer_from_json(base)
    texts = ["def frobnicate_widget(self):\n    return self.frobnicate_widget\n"] * 3
    counts = vocab.token_counts(full, texts)
    cut = vocab.cut_vocabulary(base, counts, 1024)
    tok = vocab.tokenizer_from_json(cut)
    # every token the full vocabulary used on the corpus survives the cut, so it tokenises the same
    used = [full.id_to_token(int(i)) for i in np.flatnonzero(counts)]
    assert all(t in cut["model"]["vocab"] for t in used)
    assert len(tok.encode(texts[0], add_special_tokens=False).ids) == len(
        full.encode(texts[0], add_special_tokens=False).ids
    )
    kept = cut["model"]["vocab"]
    for merge in cut["model"]["merges"]:
        left, right = merge.split(" ")
        assert left in kept and right in kept and left + right in kept
