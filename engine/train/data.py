"""``sluice train data``: corpus manifest, split, cut tokenizer, token-id arrays and baselines.

Output directory:

* ``manifest.json``: the corpus (see ``engine.train.corpus``).
* ``split.json``: the ``heldout-v1`` split: training, held-out, validation-slice and
  dropped (duplicate-of-held-out) paths.
* ``tokenizer.json``, ``tokenizer_config.json``: the cut vocabulary (``engine.train.vocab``).
* ``train.bin``, ``heldout.bin``: token ids, little-endian ``uint16`` (``uint32`` when the
  vocabulary exceeds 65,536 ids), each file's ids followed by EOS, files in manifest order.
* ``data.json``: the header describing the arrays (dtype, counts, sha256, per-file
  offsets), the corpus digest, the tokens-per-byte table and the baseline perplexities.

No pickle anywhere: JSON and raw arrays only.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from engine.train import baselines, corpus, vocab

DEFAULT_VOCAB_SIZE = 8192
MEASURED_SIZES = (2048, 4096, 8192)
DATA_FORMAT = "sluice-train-data"
DATA_VERSION = 1


class Progress:
    """Stage lines on a stream; counters at most once a second."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self._last = 0.0

    def stage(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)

    def counter(self, what: str) -> Callable[[int, int], None]:
        def tick(done: int, total: int) -> None:
            now = time.monotonic()
            if now - self._last >= 1.0 or done == total:
                self._last = now
                self.stage(f"  {what}: {done}/{total} files")

        return tick


def _stream(ids_per_file: Sequence[Sequence[int]], eos: int) -> tuple[np.ndarray, list[int]]:
    lengths = [len(ids) + 1 for ids in ids_per_file]
    out = np.empty(sum(lengths), dtype=np.int64)
    pos = 0
    for ids in ids_per_file:
        out[pos : pos + len(ids)] = ids
        out[pos + len(ids)] = eos
        pos += len(ids) + 1
    return out, lengths


def _write_array(path: Path, arr: np.ndarray, dtype: str) -> str:
    data = arr.astype(dtype).tobytes()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def read_array(out_dir: Path, name: str) -> np.ndarray:
    """A token array written by ``build_data``, per its ``data.json`` header."""
    header = json.loads((out_dir / "data.json").read_text(encoding="utf-8"))
    spec = header["arrays"][name]
    return np.fromfile(out_dir / spec["file"], dtype=np.dtype(header["dtype"]).newbyteorder("<"))


def build_data(
    out_dir: Path,
    root: Path | None = None,
    manifest: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    measure_sizes: Sequence[int] = MEASURED_SIZES,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Build everything into ``out_dir``; returns the ``data.json`` header."""
    prog = progress or Progress()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    prog.stage(
        f"corpus: reading {'manifest ' + str(manifest) if manifest else 'stdlib rule'} under {root or corpus.stdlib_root()}"
    )
    c = corpus.load_corpus(root, manifest)
    m = c.manifest
    sp = corpus.split(m)
    valid = set(sp.valid(m))
    prog.stage(
        f"corpus: {len(m.files)} files, {m.total_bytes / 1e6:.2f} MB, Python {m.python_version}, digest {m.digest[:12]}; "
        f"{sp.name}: {len(sp.train)} train ({len(valid)} of them {corpus.VALID_SLICE}), {len(sp.heldout)} held out, "
        f"{len(sp.dropped)} dropped as duplicates of held-out files"
    )
    m.write(out_dir / "manifest.json")
    paths = [f.path for f in m.files]
    split_json = {
        "name": sp.name,
        "rule": "held out iff int.from_bytes(sha256(path)[:8], 'big') % 20 == 0; valid-v1 iff == 1",
        "corpus_digest": m.digest,
        "train": [paths[i] for i in sp.train],
        "valid": [paths[i] for i in sp.train if i in valid],
        "heldout": [paths[i] for i in sp.heldout],
        "dropped": [paths[i] for i in sp.dropped],
    }
    (out_dir / "split.json").write_text(json.dumps(split_json, indent=1) + "\n", encoding="utf-8")
    train_texts = [c.texts[i] for i in sp.train]
    held_texts = [c.texts[i] for i in sp.heldout]
    if not train_texts or not held_texts:
        raise ValueError(
            f"split {sp.name} leaves {len(train_texts)} training and {len(held_texts)} held-out files"
        )

    prog.stage("vocabulary: counting full V4 tokens on the training split")
    base = vocab.base_tokenizer_json()
    full = vocab.tokenizer_from_json(base)
    counts = vocab.token_counts(full, train_texts, prog.counter("full-V4 tokenise"))
    held_bytes = sum(len(t.encode("utf-8")) for t in held_texts)
    table: dict[str, float] = {
        "full": sum(len(ids) for ids in vocab.encode_texts(full, held_texts)) / held_bytes
    }
    cuts: dict[int, dict[str, Any]] = {}
    for size in sorted({*measure_sizes, vocab_size}):
        cut = vocab.cut_vocabulary(base, counts, size)
        cuts[size] = cut
        tok = vocab.tokenizer_from_json(cut)
        table[str(size)] = sum(len(ids) for ids in vocab.encode_texts(tok, held_texts)) / held_bytes
    prog.stage("vocabulary: held-out tokens per byte: " + ", ".join(f"{k}={v:.4f}" for k, v in table.items()))
    tok_json = cuts[vocab_size]
    vocab.write_tokenizer_json(tok_json, out_dir)
    tok_sha = hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()
    tok = vocab.tokenizer_from_json(tok_json)
    ids = vocab.special_ids(tok_json)

    prog.stage(f"encoding with the {vocab_size}-id cut")
    train_ids = vocab.encode_texts(tok, train_texts, prog.counter("train tokenise"))
    held_ids = vocab.encode_texts(tok, held_texts)
    for text, enc in zip(held_texts, held_ids, strict=True):
        if tok.decode(enc, skip_special_tokens=False) != text:
            raise ValueError("the cut tokenizer does not round-trip a held-out file")
    eos = ids["eos"]
    train_stream, train_lens = _stream(train_ids, eos)
    held_stream, held_lens = _stream(held_ids, eos)
    dtype = "<u2" if vocab_size <= 1 << 16 else "<u4"

    def index(idx: Sequence[int], lens: list[int]) -> list[dict[str, Any]]:
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist() if lens else []
        return [
            {"path": paths[i], "offset": int(o), "n_tokens": int(n), "valid": i in valid}
            for i, o, n in zip(idx, offs, lens, strict=True)
        ]

    arrays = {
        "train": {
            "file": "train.bin",
            "n_tokens": len(train_stream),
            "n_files": len(train_ids),
            "sha256": _write_array(out_dir / "train.bin", train_stream, dtype),
            "files": index(sp.train, train_lens),
        },
        "heldout": {
            "file": "heldout.bin",
            "n_tokens": len(held_stream),
            "n_files": len(held_ids),
            "n_bytes": held_bytes,
            "sha256": _write_array(out_dir / "heldout.bin", held_stream, dtype),
            "files": index(sp.heldout, held_lens),
        },
    }

    prog.stage("baselines: tuning on valid-v1, refitting on the training split, scoring held-out")
    is_valid_tok = np.concatenate(
        [
            np.full(n, paths[i] in split_json["valid"], dtype=bool)
            for i, n in zip(sp.train, train_lens, strict=True)
        ]
    )
    report = baselines.fit_baselines(
        fit_stream=train_stream[~is_valid_tok],
        valid_stream=train_stream[is_valid_tok],
        train_stream=train_stream,
        heldout_stream=held_stream,
        vocab_size=vocab_size,
        boundary=eos,
    )
    tpb = len(held_stream) / held_bytes
    header: dict[str, Any] = {
        "format": DATA_FORMAT,
        "version": DATA_VERSION,
        "corpus": {
            "name": m.name,
            "python_version": m.python_version,
            "digest": m.digest,
            "n_files": len(m.files),
            "total_bytes": m.total_bytes,
        },
        "split": sp.name,
        "tokenizer": {"file": "tokenizer.json", "sha256": tok_sha, "vocab_size": vocab_size, **ids},
        "dtype": dtype,
        "layout": "each file's ids then EOS, files in manifest order",
        "heldout_tokens_per_byte": table,
        "arrays": arrays,
        "baselines": {
            **report.to_json(),
            "unigram_heldout_bits_per_byte": float(np.log2(report.unigram_heldout_ppl) * tpb),
            "bigram_heldout_bits_per_byte": float(np.log2(report.bigram_heldout_ppl) * tpb),
            "smoothing": "unigram add-k; bigram interpolated Kneser-Ney (absolute discount d)",
        },
    }
    (out_dir / "data.json").write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
    prog.stage(
        f"done: {len(train_stream)} train tokens, {len(held_stream)} held-out tokens; held-out perplexity "
        f"unigram {report.unigram_heldout_ppl:.2f} (k={report.unigram_k}), "
        f"bigram {report.bigram_heldout_ppl:.2f} (KN d={report.bigram_d})"
    )
    return header
