"""The training corpus: the ``.py`` files of a Python standard library, pinned by a manifest.

Rule (``CORPUS_RULE``): every regular file ending in ``.py`` under the stdlib directory
(``sysconfig.get_paths()["stdlib"]``), walked without following directory symlinks, except

* any file with a path component in ``EXCLUDED_DIRS`` (``site-packages``, ``dist-packages``,
  ``__pycache__``, and the test suites and their data: ``test``, ``tests``, ``idle_test``,
  which covers ``test/``, ``lib2to3/tests/`` and ``idlelib/idle_test/``);
* empty files (the many empty ``__init__.py`` carry no text and would be duplicates);
* files whose bytes are not strict UTF-8.

Files are ordered by relative POSIX path. Text is the file's bytes decoded as UTF-8 with no
newline translation, so the bytes hashed are the bytes trained on.

Python versions differ between machines, so a corpus is defined by its manifest (path,
size, sha256 per file, the Python version it was taken from, and a digest over all of it),
not by "whatever stdlib is installed": ``load_corpus(root, manifest)`` reads exactly the
manifest's files from ``root`` (e.g. a copied 3.11 stdlib tree on a 3.12 host) and fails,
naming the files, if any is missing or differs.

Held-out split ``heldout-v1`` (fixed forever): a file is held out when the first 8 bytes of
sha256 of its relative path, read big-endian, are 0 mod 20 (about 5% of files). The choice
depends on the path alone, so it is the same on every machine and Python version. A file
whose content is byte-identical to a held-out file's is dropped from training too, so no
held-out text is ever trained on. The validation slice ``valid-v1`` (the same hash, 1 mod
20) is part of the training split; baselines tune their smoothing on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS_NAME = "python-stdlib-py"
CORPUS_RULE = (
    "stdlib *.py; no site-packages/dist-packages/__pycache__/test/tests/idle_test; non-empty; strict UTF-8"
)
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
HELDOUT_SPLIT = "heldout-v1"
VALID_SLICE = "valid-v1"
_SPLIT_MOD = 20
MANIFEST_VERSION = 1


class CorpusMismatch(ValueError):
    """The files under a root do not match the manifest."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    name: str
    rule: str
    python_version: str
    files: tuple[FileEntry, ...]

    @property
    def digest(self) -> str:
        return corpus_digest(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "name": self.name,
            "rule": self.rule,
            "python_version": self.python_version,
            "n_files": len(self.files),
            "total_bytes": self.total_bytes,
            "digest": self.digest,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        files = tuple(FileEntry(f["path"], int(f["size"]), f["sha256"]) for f in obj["files"])
        m = cls(obj["name"], obj["rule"], obj["python_version"], files)
        if "digest" in obj and obj["digest"] != m.digest:
            raise CorpusMismatch(f"manifest digest {obj['digest']} does not match its file list ({m.digest})")
        return m

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


@dataclass(frozen=True)
class Corpus:
    manifest: Manifest
    root: Path
    texts: tuple[str, ...]  # in manifest order

    def items(self) -> list[tuple[FileEntry, str]]:
        return list(zip(self.manifest.files, self.texts, strict=True))


def corpus_digest(files: tuple[FileEntry, ...] | list[FileEntry]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: str) -> bool:
    return any(part in EXCLUDED_DIRS for part in rel.split("/")[:-1])


def scan(root: Path) -> list[tuple[str, bytes]]:
    """Every file the rule admits under ``root``, as (relative path, bytes), sorted by path."""
    out: list[tuple[str, bytes]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if not full.is_file():
                continue
            rel = full.relative_to(root).as_posix()
            if _excluded(rel):
                continue
            data = full.read_bytes()
            if not data:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append((rel, data))
    out.sort(key=lambda item: item[0])
    return out


def build_manifest(root: Path | None = None) -> tuple[Manifest, list[str]]:
    """Scan ``root`` (default: this interpreter's stdlib); the manifest and the texts."""
    root = Path(root) if root is not None else stdlib_root()
    found = scan(root)
    files = tuple(FileEntry(rel, len(data), hashlib.sha256(data).hexdigest()) for rel, data in found)
    version = "{}.{}.{}".format(*sys.version_info[:3])
    return Manifest(CORPUS_NAME, CORPUS_RULE, version, files), [d.decode("utf-8") for _, d in found]


def load_corpus(root: Path | None = None, manifest: Manifest | Path | None = None) -> Corpus:
    """The corpus under ``root`` (default: this stdlib).

    Without a manifest, the rule is applied to ``root`` and a manifest is built. With one,
    exactly its files are read from ``root`` and checked (size and sha256); any missing or
    differing file raises ``CorpusMismatch`` naming them. Files under ``root`` that the
    manifest does not list are ignored: the manifest defines the corpus.
    """
    root = Path(root) if root is not None else stdlib_root()
    if manifest is None:
        m, texts = build_manifest(root)
        return Corpus(m, root, tuple(texts))
    if not isinstance(manifest, Manifest):
        manifest = Manifest.read(Path(manifest))
    missing: list[str] = []
    differ: list[str] = []
    texts = []
    for f in manifest.files:
        full = root / f.path
        try:
            data = full.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            missing.append(f.path)
            continue
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            differ.append(f.path)
            continue
        texts.append(data.decode("utf-8"))
    if missing or differ:
        parts = [
            f"corpus under {root} does not match manifest (Python {manifest.python_version}, {manifest.digest[:12]})"
        ]
        if missing:
            parts.append(
                f"{len(missing)} missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
            )
        if differ:
            parts.append(
                f"{len(differ)} differ: {', '.join(differ[:10])}{' ...' if len(differ) > 10 else ''}"
            )
        raise CorpusMismatch("; ".join(parts))
    return Corpus(manifest, root, tuple(texts))


def _path_bucket(path: str) -> int:
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") % _SPLIT_MOD


def is_heldout(path: str) -> bool:
    """Whether ``path`` belongs to the ``heldout-v1`` split (from the path alone)."""
    return _path_bucket(path) == 0


def is_valid(path: str) -> bool:
    """Whether ``path`` is in the ``valid-v1`` slice of the training split."""
    return _path_bucket(path) == 1


@dataclass(frozen=True)
class Split:
    name: str
    train: tuple[int, ...]  # indices into the manifest's files
    heldout: tuple[int, ...]
    dropped: tuple[int, ...]  # training-side files whose content equals a held-out file's

    def valid(self, manifest: Manifest) -> tuple[int, ...]:
        return tuple(i for i in self.train if is_valid(manifest.files[i].path))

    def fit(self, manifest: Manifest) -> tuple[int, ...]:
        """The training files minus the validation slice."""
        return tuple(i for i in self.train if not is_valid(manifest.files[i].path))


def split(manifest: Manifest) -> Split:
    """The ``heldout-v1`` split of ``manifest``."""
    held = [i for i, f in enumerate(manifest.files) if is_heldout(f.path)]
    held_sha = {manifest.files[i].sha256 for i in held}
    train: list[int] = []
    dropped: list[int] = []
    for i, f in enumerate(manifest.files):
        if is_heldout(f.path):
            continue
        (dropped if f.sha256 in held_sha else train).append(i)
    return Split(HELDOUT_SPLIT, tuple(train), tuple(held), tuple(dropped))
