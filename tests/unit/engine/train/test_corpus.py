"""Corpus rule, manifest verification and the heldout-v1 split."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.train import corpus
from engine.train.corpus import CorpusMismatch, Manifest, build_manifest, is_heldout, load_corpus, split


def _tree(root: Path) -> Path:
    files = {
        "a.py": b"x = 1\n",
        "pkg/__init__.py": b"",  # empty: excluded
        "pkg/b.py": "s = 'caf\u00e9'\n".encode(),
        "pkg/c.txt": b"not python\n",
        "latin.py": "s = 'caf\u00e9'\n".encode("latin-1"),  # not UTF-8: excluded
        "test/test_a.py": b"assert True\n",
        "lib2to3/tests/data/x.py": b"print 1\n",
        "idlelib/idle_test/t.py": b"pass\n",
        "idlelib/run.py": b"pass\n",
        "site-packages/numpy/x.py": b"pass\n",
        "__pycache__/a.py": b"pass\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_rule_keeps_only_nonempty_utf8_py_outside_tests(tmp_path):
    m, texts = build_manifest(_tree(tmp_path))
    assert [f.path for f in m.files] == ["a.py", "idlelib/run.py", "pkg/b.py"]
    assert texts[2] == "s = 'caf\u00e9'\n"
    assert m.files[2].size == len(texts[2].encode())


def test_manifest_round_trips_and_verifies(tmp_path):
    root = _tree(tmp_path / "src")
    m = load_corpus(root).manifest
    m.write(tmp_path / "manifest.json")
    again = Manifest.read(tmp_path / "manifest.json")
    assert again == m and again.digest == m.digest
    # a copied tree with an extra file still loads: the manifest defines the corpus
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "extra.py").write_text("y = 2\n")
    assert load_corpus(copy, tmp_path / "manifest.json").texts == load_corpus(root, m).texts


def test_manifest_names_changed_and_missing_files(tmp_path):
    root = _tree(tmp_path)
    m = load_corpus(root).manifest
    (root / "a.py").write_bytes(b"x = 2\n")  # same size, different bytes
    (root / "pkg/b.py").unlink()
    with pytest.raises(CorpusMismatch) as err:
        load_corpus(root, m)
    msg = str(err.value)
    assert "1 missing: pkg/b.py" in msg and "1 differ: a.py" in msg


def test_tampered_manifest_is_refused(tmp_path):
    m = load_corpus(_tree(tmp_path)).manifest
    obj = m.to_json()
    obj["files"][0]["sha256"] = "0" * 64
    with pytest.raises(CorpusMismatch, match="digest"):
        Manifest.from_json(json.loads(json.dumps(obj)))


def test_heldout_v1_is_fixed_by_path():
    # pinned forever: changing the split rule must fail this test
    assert corpus.HELDOUT_SPLIT == "heldout-v1"
    for path in ("operator.py", "runpy.py", "importlib/machinery.py", "asyncio/locks.py"):
        assert is_heldout(path), path
    for path in ("os.py", "json/__init__.py", "fnmatch.py", "this.py"):
        assert not is_heldout(path), path
    assert corpus.is_valid("fnmatch.py") and corpus.is_valid("this.py")


def test_split_is_deterministic_disjoint_and_drops_heldout_duplicates(subset_tree, tmp_path):
    m = load_corpus(subset_tree).manifest
    s = split(m)
    assert s == split(m)
    assert set(s.train).isdisjoint(s.heldout)
    assert sorted(s.train + s.heldout + s.dropped) == list(range(len(m.files)))
    assert {m.files[i].path for i in s.heldout} >= {"operator.py", "runpy.py"}
    # a training-side file with a held-out file's exact text is dropped, never trained on
    root = tmp_path / "dup"
    shutil.copytree(subset_tree, root)
    shutil.copyfile(root / "operator.py", root / "operator_copy.py")
    c = load_corpus(root)
    s2 = split(c.manifest)
    assert [c.manifest.files[i].path for i in s2.dropped] == ["operator_copy.py"]
    held_texts = {c.texts[i] for i in s2.heldout}
    assert not any(c.texts[i] in held_texts for i in s2.train)


def test_this_interpreters_stdlib():
    m, _ = build_manifest()
    assert len(m.files) > 300
    assert not any(set(f.path.split("/")[:-1]) & corpus.EXCLUDED_DIRS for f in m.files)
    assert [f.path for f in m.files] == sorted(f.path for f in m.files)
    assert 0.02 < sum(is_heldout(f.path) for f in m.files) / len(m.files) < 0.08
