"""Model fingerprint: a digest of what a checkpoint IS, not of where it lives.

Prefix-cache block hashes and the shared KV store need a model identity that two servers
agree on when, and only when, their KV would be identical. The folder's name is not that:
two copies of one checkpoint under different names would never share blocks, and a folder
re-filled with other weights under the same name would serve stale KV. So::

    model_fingerprint(model_dir, dtype, layout_version) -> 64 hex chars (SHA-256)

covers, each length-prefixed, in this order:

* the domain string ``sluice-model-fingerprint-v1``;
* ``config.json`` in canonical form (``json.loads`` then ``json.dumps`` with
  ``sort_keys=True, separators=(",", ":")``), so whitespace and key order do not matter;
* the weights digest: for every ``*.safetensors`` file directly in the folder, sorted by
  name, its name relative to the folder and the ``xxh3_128`` of its bytes (read in 16 MiB
  chunks). The folder's path, the files' mtimes and owners never enter it;
* the dtype name (a leading ``torch.`` is dropped, so ``str(torch.bfloat16)`` and
  ``"bfloat16"`` agree) and the KV layout version.

Hashing a real checkpoint reads every byte (hundreds of GB for V4), so per-file digests are
cached in a sidecar, ``sluice_fingerprint.json`` in the checkpoint folder, keyed by file name.
A cached digest is used only while the file's ``(size, mtime_ns)`` still match; those two
decide whether to re-hash and are never part of the fingerprint. A copied folder (new
mtimes) simply re-hashes. The sidecar is written atomically (temporary file + rename); in a
read-only folder it is not written (logged at debug level), and every start re-hashes.
A digest of a file modified less than ``_RACY_S`` seconds before it was hashed is not cached:
a second write within the filesystem's timestamp granularity could keep size and mtime.

A folder without any ``*.safetensors`` file (random in-place weights) has no content to
fingerprint: ``model_fingerprint`` raises ``FileNotFoundError`` rather than return an
identity that two different random models would share.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

DOMAIN = "sluice-model-fingerprint-v1"
SIDECAR_NAME = "sluice_fingerprint.json"
CHUNK_BYTES = 16 << 20  # read size while hashing a weights file
LOG_ABOVE_BYTES = 1 << 30  # hashing more than this is announced at INFO
_SIDECAR_VERSION = 1
_ALGORITHM = "xxh3_128"
_RACY_S = 2.0  # coarse filesystems keep mtime at 1-2 s granularity


@dataclass(frozen=True)
class _Stat:
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> _Stat:
        st = path.stat()
        return cls(size=st.st_size, mtime_ns=st.st_mtime_ns)


def _frame(h: hashlib._Hash, data: bytes) -> None:
    """Length-prefixed field: no two different field sequences feed the same bytes."""
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def canonical_config(model_dir: str | Path) -> bytes:
    """``config.json`` re-serialised with sorted keys and no whitespace (UTF-8 bytes)."""
    text = (Path(model_dir) / "config.json").read_text(encoding="utf-8")
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode("utf-8")


def hash_file(path: str | Path) -> str:
    """``xxh3_128`` hex digest of a file's bytes, streamed in ``CHUNK_BYTES`` reads."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _weight_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors") if p.is_file())


def _read_sidecar(root: Path) -> dict[str, dict[str, object]]:
    """The sidecar's per-file entries, or {} when absent, unreadable or of another format."""
    try:
        raw = json.loads((root / SIDECAR_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(raw, dict)
        or raw.get("version") != _SIDECAR_VERSION
        or raw.get("algorithm") != _ALGORITHM
    ):
        return {}
    files = raw.get("files")
    return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}


def _cached_digest(entry: dict[str, object] | None, stat: _Stat) -> str | None:
    if entry is None or entry.get("size") != stat.size or entry.get("mtime_ns") != stat.mtime_ns:
        return None
    digest = entry.get("digest")
    if isinstance(digest, str) and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest):
        return digest
    return None


def _write_sidecar(root: Path, files: dict[str, dict[str, object]]) -> None:
    """Atomically replace the sidecar; silently skipped (debug log) where the folder is not writable."""
    body = json.dumps(
        {"version": _SIDECAR_VERSION, "algorithm": _ALGORITHM, "files": files}, indent=1, sort_keys=True
    )
    tmp = root / f".{SIDECAR_NAME}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / SIDECAR_NAME)
    except OSError as e:
        log.debug("model fingerprint: not caching file digests in %s (%s)", root, e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _hash_stable(path: Path, before: _Stat) -> tuple[str, _Stat]:
    """Digest and stat of a file that did not change while it was read (three tries, then RuntimeError)."""
    for _ in range(3):
        digest = hash_file(path)
        after = _Stat.of(path)
        if after == before:
            return digest, after
        before = after
    raise RuntimeError(f"{path} keeps changing while it is hashed; cannot fingerprint the model")


def weight_file_digests(model_dir: str | Path) -> dict[str, str]:
    """``{file name: xxh3_128 hex}`` for every ``*.safetensors`` in the folder, sorted by name.

    Digests come from the sidecar where its ``(size, mtime_ns)`` still match the file, else
    the file is hashed; the sidecar is rewritten when anything changed.
    """
    root = Path(model_dir)
    names = _weight_files(root)
    cached = _read_sidecar(root)
    stats = {name: _Stat.of(root / name) for name in names}
    digests: dict[str, str] = {}
    todo: list[str] = []
    for name in names:
        hit = _cached_digest(cached.get(name), stats[name])
        if hit is None:
            todo.append(name)
        else:
            digests[name] = hit

    entries: dict[str, dict[str, object]] = {
        name: cached[name] for name in names if name in digests
    }  # drop entries of removed files
    if todo:
        total = sum(stats[name].size for name in todo)
        loud = total > LOG_ABOVE_BYTES
        if loud:
            log.info(
                "model fingerprint: hashing %d weight file(s), %.1f GiB, in %s (cached in %s afterwards)",
                len(todo),
                total / (1 << 30),
                root,
                SIDECAR_NAME,
            )
        t0 = time.perf_counter()
        for name in todo:
            started_ns = time.time_ns()
            digest, stat = _hash_stable(root / name, stats[name])
            digests[name] = digest
            if started_ns - stat.mtime_ns >= _RACY_S * 1e9:
                entries[name] = {"size": stat.size, "mtime_ns": stat.mtime_ns, "digest": digest}
        if loud:
            dt = time.perf_counter() - t0
            log.info(
                "model fingerprint: hashed %.1f GiB in %.1f s (%.2f GiB/s)",
                total / (1 << 30),
                dt,
                total / (1 << 30) / max(dt, 1e-9),
            )
    if entries != cached:
        _write_sidecar(root, entries)
    return {name: digests[name] for name in names}


def weights_digest(model_dir: str | Path) -> str:
    """SHA-256 hex over the sorted ``(file name, xxh3_128)`` pairs of the folder's weight files."""
    files = weight_file_digests(model_dir)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}: a model without weight files has no content fingerprint"
        )
    h = hashlib.sha256()
    _frame(h, str(len(files)).encode())
    for name, digest in files.items():
        _frame(h, name.encode("utf-8"))
        _frame(h, bytes.fromhex(digest))
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path, dtype: str, layout_version: int) -> str:
    """64 hex chars (SHA-256) naming the model by content: config, weights, dtype, layout version.

    ``dtype`` is the dtype the weights are served in (``"bfloat16"``, ``"float8_e4m3fn"``; a
    ``torch.`` prefix is dropped); ``layout_version`` is the KV cache layout's version, so a
    layout change never reuses blocks written under the old one.
    """
    if not isinstance(dtype, str) or not dtype.removeprefix("torch."):
        raise ValueError(f"dtype must be a non-empty dtype name such as 'bfloat16', got {dtype!r}")
    if isinstance(layout_version, bool) or not isinstance(layout_version, int) or layout_version < 0:
        raise ValueError(f"layout_version must be an int >= 0, got {layout_version!r}")
    h = hashlib.sha256()
    _frame(h, DOMAIN.encode())
    _frame(h, canonical_config(model_dir))
    _frame(h, bytes.fromhex(weights_digest(model_dir)))
    _frame(h, dtype.removeprefix("torch.").encode())
    _frame(h, str(layout_version).encode())
    return h.hexdigest()


def random_weights_fingerprint(model_dir: str | Path, seed: int, dtype: str, layout_version: int) -> str:
    """The fingerprint of an engine serving seeded random weights (``EngineConfig.random_weights``):
    config, seed, dtype and layout, in a domain of its own, so its blocks never meet a real
    checkpoint's."""
    h = hashlib.sha256()
    _frame(h, (DOMAIN + ":random-weights").encode())
    _frame(h, canonical_config(model_dir))
    _frame(h, str(int(seed)).encode())
    _frame(h, dtype.removeprefix("torch.").encode())
    _frame(h, str(layout_version).encode())
    return h.hexdigest()
