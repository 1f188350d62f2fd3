"""The model fingerprint follows the checkpoint's content (config, weight bytes, dtype, layout), not its path."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from engine.checkpoint import fingerprint as fp
from engine.checkpoint.fingerprint import SIDECAR_NAME, model_fingerprint

OLD = 10_000  # seconds in the past: outside the racy window, so digests are cached


def _age(folder: Path, seconds_ago: float = OLD) -> None:
    """Set every weight file's mtime well in the past (a checkpoint written long before serving)."""
    t = time.time() - seconds_ago
    for p in folder.glob("*.safetensors"):
        os.utime(p, (t, t))


@pytest.fixture()
def ckpt(checkpoint_factory, tmp_path: Path) -> Path:
    """A private copy of the generated tiny checkpoint (the tests modify it)."""
    out = tmp_path / "tiny-a"
    shutil.copytree(checkpoint_factory("tiny"), out)
    (out / SIDECAR_NAME).unlink(missing_ok=True)
    _age(out)
    return out


@pytest.fixture()
def hash_calls(monkeypatch) -> list[str]:
    """Names of the files actually hashed (not served from the sidecar)."""
    calls: list[str] = []
    real = fp.hash_file

    def counting(path):
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(fp, "hash_file", counting)
    return calls


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_fingerprint_is_sha256_hex_and_deterministic(ckpt):
    a = model_fingerprint(ckpt, "bfloat16", 1)
    assert len(a) == 64 and int(a, 16) >= 0
    assert model_fingerprint(ckpt, "bfloat16", 1) == a  # now from the sidecar
    assert model_fingerprint(str(ckpt), "torch.bfloat16", 1) == a  # str path, torch dtype name


def test_copy_under_another_name_and_path_has_the_same_fingerprint(ckpt, tmp_path):
    other = tmp_path / "elsewhere" / "renamed-model"
    other.parent.mkdir()
    shutil.copytree(ckpt, other, copy_function=shutil.copyfile)  # new mtimes
    _age(other, seconds_ago=2 * OLD)
    assert model_fingerprint(other, "bfloat16", 1) == model_fingerprint(ckpt, "bfloat16", 1)


def test_one_weight_byte_changes_the_fingerprint(ckpt, tmp_path):
    before = model_fingerprint(ckpt, "bfloat16", 1)
    copy = tmp_path / "flipped"
    shutil.copytree(ckpt, copy)
    weights = copy / "model.safetensors"
    _flip_byte(weights, weights.stat().st_size // 2)
    _age(copy, seconds_ago=OLD / 2)  # the sidecar copied along no longer matches the mtime
    assert model_fingerprint(copy, "bfloat16", 1) != before


def test_dtype_layout_and_config_enter_the_fingerprint(ckpt):
    base = model_fingerprint(ckpt, "bfloat16", 1)
    assert model_fingerprint(ckpt, "float8_e4m3fn", 1) != base
    assert model_fingerprint(ckpt, "bfloat16", 2) != base

    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # the same config re-serialised (other key order, other whitespace) is the same model
    cfg_path.write_text(json.dumps(dict(reversed(list(cfg.items()))), indent=7))
    assert model_fingerprint(ckpt, "bfloat16", 1) == base
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    cfg_path.write_text(json.dumps(cfg))
    assert model_fingerprint(ckpt, "bfloat16", 1) != base


def test_weight_file_names_enter_the_fingerprint_but_not_other_files(ckpt):
    base = model_fingerprint(ckpt, "bfloat16", 1)
    (ckpt / "README.md").write_text("not a weight file")
    assert model_fingerprint(ckpt, "bfloat16", 1) == base
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    assert model_fingerprint(ckpt, "bfloat16", 1) != base


def test_sidecar_is_reused_and_invalidated_when_a_file_changes(ckpt, hash_calls):
    extra = ckpt / "model-extra.safetensors"
    extra.write_bytes(os.urandom(1 << 16))
    _age(ckpt)
    first = model_fingerprint(ckpt, "bfloat16", 1)
    assert sorted(hash_calls) == ["model-extra.safetensors", "model.safetensors"]
    side = json.loads((ckpt / SIDECAR_NAME).read_text())
    assert set(side["files"]) == {"model-extra.safetensors", "model.safetensors"}

    hash_calls.clear()
    assert model_fingerprint(ckpt, "bfloat16", 1) == first
    assert model_fingerprint(ckpt, "float8_e4m3fn", 3) != first  # other args, same cached digests
    assert hash_calls == []

    # same content, new mtime: re-hashed (the cache is keyed by size and mtime only), same result
    t = time.time() - OLD / 2
    os.utime(extra, (t, t))
    assert model_fingerprint(ckpt, "bfloat16", 1) == first
    assert hash_calls == ["model-extra.safetensors"]

    # changed content (same size): re-hashed, new fingerprint, and the sidecar follows
    hash_calls.clear()
    _flip_byte(extra, 7)
    os.utime(extra, (t - 5, t - 5))
    changed = model_fingerprint(ckpt, "bfloat16", 1)
    assert changed != first and hash_calls == ["model-extra.safetensors"]
    hash_calls.clear()
    assert model_fingerprint(ckpt, "bfloat16", 1) == changed and hash_calls == []

    # a removed file leaves the sidecar too
    extra.unlink()
    assert model_fingerprint(ckpt, "bfloat16", 1) not in (first, changed)
    assert set(json.loads((ckpt / SIDECAR_NAME).read_text())["files"]) == {"model.safetensors"}


def test_copied_sidecar_with_other_mtimes_is_not_trusted(ckpt, tmp_path, hash_calls):
    model_fingerprint(ckpt, "bfloat16", 1)
    other = tmp_path / "copy"
    shutil.copytree(ckpt, other, copy_function=shutil.copyfile)  # sidecar copied, mtimes not
    _age(other, seconds_ago=OLD * 3)
    # a tampered copy: its sidecar still holds the original digest, the bytes differ
    _flip_byte(other / "model.safetensors", 100)
    _age(other, seconds_ago=OLD * 3)
    hash_calls.clear()
    assert model_fingerprint(other, "bfloat16", 1) != model_fingerprint(ckpt, "bfloat16", 1)
    assert hash_calls == ["model.safetensors"]


def test_freshly_written_file_is_hashed_but_not_cached(ckpt, hash_calls):
    _age(ckpt, seconds_ago=0)  # mtime == now: a second write could keep size and mtime
    a = model_fingerprint(ckpt, "bfloat16", 1)
    assert model_fingerprint(ckpt, "bfloat16", 1) == a
    assert hash_calls == ["model.safetensors", "model.safetensors"]
    assert not (ckpt / SIDECAR_NAME).exists()


def test_unwritable_folder_still_fingerprints_and_leaves_nothing(ckpt, monkeypatch, caplog):
    def refuse(src, dst):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level("DEBUG", logger=fp.__name__):
        a = model_fingerprint(ckpt, "bfloat16", 1)
    assert len(a) == 64
    assert not (ckpt / SIDECAR_NAME).exists()
    assert [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")] == []
    assert any("not caching" in r.getMessage() for r in caplog.records)


def test_corrupt_sidecar_is_ignored(ckpt, hash_calls):
    a = model_fingerprint(ckpt, "bfloat16", 1)
    (ckpt / SIDECAR_NAME).write_text("{not json")
    hash_calls.clear()
    assert model_fingerprint(ckpt, "bfloat16", 1) == a
    assert hash_calls == ["model.safetensors"]
    json.loads((ckpt / SIDECAR_NAME).read_text())  # rewritten


def test_large_hash_is_announced(ckpt, monkeypatch, caplog):
    monkeypatch.setattr(fp, "LOG_ABOVE_BYTES", 1024)
    with caplog.at_level("INFO", logger=fp.__name__):
        model_fingerprint(ckpt, "bfloat16", 1)
    assert any("hashing 1 weight file" in r.getMessage() for r in caplog.records)


def test_bad_arguments_and_missing_weights(ckpt, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        model_fingerprint(ckpt, "", 1)
    with pytest.raises(ValueError, match="layout_version"):
        model_fingerprint(ckpt, "bfloat16", -1)
    empty = tmp_path / "config-only"
    empty.mkdir()
    shutil.copy(ckpt / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        model_fingerprint(empty, "bfloat16", 1)
