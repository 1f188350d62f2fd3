"""A small stdlib subset, copied into a temporary tree, ``sluice train data`` run on it once, and a
small model trained on that once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.train.corpus import stdlib_root

# Held out under heldout-v1: operator.py, runpy.py, importlib/machinery.py.
# In valid-v1: fnmatch.py, quopri.py, this.py. The rest train.
SUBSET = (
    "abc.py",
    "bisect.py",
    "colorsys.py",
    "contextlib.py",
    "copy.py",
    "fnmatch.py",
    "glob.py",
    "heapq.py",
    "importlib/machinery.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/scanner.py",
    "keyword.py",
    "numbers.py",
    "operator.py",
    "queue.py",
    "quopri.py",
    "runpy.py",
    "sched.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
    "this.py",
    "token.py",
)


def copy_subset(dest: Path) -> Path:
    src = stdlib_root()
    for rel in SUBSET:
        if (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dest / rel)
    return dest


@pytest.fixture(scope="session")
def subset_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_subset(tmp_path_factory.mktemp("stdlib-subset"))


@pytest.fixture(scope="session")
def built(subset_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sluice train data`` on the subset, through the CLI, with a 1024-id vocabulary."""
    from services.cli import main

    out = tmp_path_factory.mktemp("train-data")
    rc = main(["train", "data", "--out", str(out), "--root", str(subset_tree), "--vocab-size", "1024"])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def trained(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`sluice train model` at the small shape on ``built`` (read only: stages write elsewhere)."""
    from engine.train.trainer import train

    from .small import SETTINGS, SMALL

    out = tmp_path_factory.mktemp("trained")
    train(built, out, SETTINGS, model_overrides=SMALL)
    return out
