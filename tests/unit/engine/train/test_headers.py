"""Held-out function headers (``engine.train.headers``) on the conftest's stdlib subset."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.train import headers as hd
from engine.train.corpus import stdlib_root
from engine.train.data import read_array

HELDOUT = ("importlib/machinery.py", "operator.py", "runpy.py")  # the subset's heldout-v1 files


@pytest.fixture(scope="module")
def texts(built: Path) -> dict[str, str]:
    return hd.heldout_texts(built)


@pytest.fixture(scope="module")
def model_dir(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny checkpoint that speaks the data directory's cut vocabulary."""
    from engine.checkpoint.generate import generate_checkpoint

    data = json.loads((built / "data.json").read_text(encoding="utf-8"))["tokenizer"]
    out = tmp_path_factory.mktemp("ckpt-tiny-datavocab")
    generate_checkpoint("tiny", out, vocab_size=data["vocab_size"])  # embedding rows = the data's ids
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(built / name, out / name)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / name).read_text(encoding="utf-8"))
        cfg.update(bos_token_id=data["bos"], eos_token_id=data["eos"])
        (out / name).write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert cfg["vocab_size"] == data["vocab_size"]
    return out


def test_heldout_texts_are_the_stdlib_files(texts: dict[str, str]) -> None:
    assert sorted(texts) == sorted(HELDOUT)
    root = stdlib_root()
    for path, text in texts.items():
        assert text.encode("utf-8") == (root / path).read_bytes()


def test_tampered_heldout_raises(built: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(built, data)
    header = json.loads((data / "data.json").read_text(encoding="utf-8"))
    entry = next(f for f in header["arrays"]["heldout"]["files"] if f["path"] == "operator.py")
    arr = read_array(data, "heldout").copy()
    i = entry["offset"] + 10
    arr[i] = 200 if arr[i] != 200 else 201  # another regular token: other text
    arr.astype(np.dtype(header["dtype"])).tofile(data / "heldout.bin")
    with pytest.raises(hd.HeldoutMismatch, match="operator.py"):
        hd.heldout_texts(data)


def test_select_headers_deterministic_and_spread(texts: dict[str, str]) -> None:
    picked = hd.select_headers(texts, 5)
    assert picked == hd.select_headers(dict(reversed(texts.items())), 5)
    # Round-robin over files by path: machinery.py has one candidate, so round 1 covers all three.
    assert [h.path for h in picked[:3]] == sorted(HELDOUT)
    assert {h.path for h in picked[3:]} == {"operator.py", "runpy.py"}
    assert len({(h.path, h.lineno) for h in picked}) == 5
    for h in picked:
        lines = texts[h.path].splitlines(keepends=True)
        assert h.text.endswith(":\n") and len(h.text) <= hd.MAX_HEADER_CHARS
        assert "".join(lines[h.lineno - 1 : h.lineno - 1 + h.text.count("\n")]) == h.text
        ast.parse(h.text + "    pass\n")
        assert h.text.startswith(("def ", "async def ")) and f" {h.name}(" in h.text
    with pytest.raises(ValueError, match="fewer than"):
        hd.select_headers(texts, 10_000)


def test_header_tokens_are_the_in_file_tokens(built: Path, texts: dict[str, str]) -> None:
    """A header prompt has the ids the header has inside its file (it ends at a line end)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(built / "tokenizer.json"))
    for h in hd.select_headers(texts, 5):
        text = texts[h.path]
        start = len("".join(text.splitlines(keepends=True)[: h.lineno - 1]))
        enc = tok.encode(text, add_special_tokens=False)
        inside = [i for i, (a, b) in zip(enc.ids, enc.offsets) if a >= start and b <= start + len(h.text)]
        assert tok.encode(h.text, add_special_tokens=False).ids == inside


def test_file_headers_rule() -> None:
    src = (
        "import x\n"
        "@deco\n"
        "def a(x,\n"
        "      y: dict[str, int] = {'k': 1}) -> int:\n"
        '    """doc"""\n'
        "def b(): return 1\n"  # body on the def's line
        "async def c(z=lambda q: q):\n"
        "    pass\n"
        "def d():  # a trailing comment\n"
        "    pass\n"
        "class K:\n"
        "    def method(self):\n"  # not module level
        "        pass\n"
        "def e(a,\n"
        "\n"
        "      b):\n"  # a blank line inside: the cut would split it
        "    pass\n"
        f"def f({'a' * hd.MAX_HEADER_CHARS}):\n"  # too long
        "    pass\n"
    )
    got = hd.file_headers("m.py", src)
    assert [(h.name, h.lineno, h.text) for h in got] == [
        ("a", 3, "def a(x,\n      y: dict[str, int] = {'k': 1}) -> int:\n"),
        ("c", 7, "async def c(z=lambda q: q):\n"),
    ]


def test_cut_rule() -> None:
    cut = hd.cut_at_blank_line
    assert cut("def f():\n    return 1\n\ndef g():\n") == "def f():\n    return 1\n"
    assert cut("def f():\n    x = 1\n    \t\n    y\n") == "def f():\n    x = 1\n"  # whitespace only
    assert cut("def f():\n    return 1") == "def f():\n    return 1"  # no blank line: all of it
    assert cut("def f():\r\n    pass\r\n\r\nzzz") == "def f():\r\n    pass\r\n"
    assert cut("a\n   ") == "a\n"  # a trailing whitespace-only line counts as blank
    # a blank line inside a string is part of the string (PEP 257 docstrings), not a cut
    doc = 'def f():\n    """Summary.\n\n    Details.\n    """\n    return 1\n\nx = 2\n'
    assert cut(doc) == doc[: doc.index("\nx = 2")]
    assert hd.parse_error(cut(doc)) is None
    open_doc = 'def f():\n    """Summary.\n\n    never closed'
    assert cut(open_doc) == open_doc  # no blank line outside a string: all of it
    h = hd.Header("m.py", "f", 1, "def f(x):\n")
    ok = hd.read_continuation(h, "    return x\n\n garbage (")
    assert ok.parses and ok.error is None and ok.cut == "def f(x):\n    return x\n"
    bad = hd.read_continuation(h, "    return (x\n")
    assert not bad.parses and bad.error
    assert not hd.read_continuation(h, "\n    return x\n").parses  # cut leaves the header alone


def test_continue_headers_end_to_end(texts: dict[str, str], model_dir: Path) -> None:
    picked = hd.select_headers(texts, 4)
    conts = hd.continue_headers(model_dir, picked, max_tokens=12)
    assert [c.header for c in conts] == picked
    for c in conts:
        assert c.finish_reason in ("stop", "length")
        assert c.cut == hd.cut_at_blank_line(c.header.text + c.continuation)
        assert c.cut.startswith(c.header.text) and (c.header.text + c.continuation).startswith(c.cut)
        try:
            ast.parse(c.cut)
            parses = True
        except SyntaxError:
            parses = False
        assert c.parses == parses and (c.error is None) == parses
    md = hd.render_markdown(conts)
    assert md.startswith(f"**{sum(c.parses for c in conts)} of 4 parse**")
    assert md.count("```python") == 4 and all(f"### {c.header.path}: {c.header.name}" in md for c in conts)


def test_a_header_in_its_file_carries_whole_lines_before_it(built: Path, texts: dict[str, str]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(built / "tokenizer.json"))
    for h in hd.select_headers(texts, 3):
        assert texts[h.path].startswith(h.before + h.text) and h.before
        assert hd.file_context(tok, h.before, 0) == ""
        assert hd.file_context(tok, h.before, 10**6) == h.before
        for n in (5, 50, 500):
            ctx = hd.file_context(tok, h.before, n)
            assert h.before.endswith(ctx)
            rest = h.before[: len(h.before) - len(ctx)]
            assert rest == "" or rest.endswith("\n")  # whole lines
            assert len(tok.encode(ctx, add_special_tokens=False).ids) <= n


def test_run_headers_report(built: Path, model_dir: Path) -> None:
    report = hd.run_headers(model_dir, built, n=3, max_tokens=4)
    json.dumps(report)
    assert report["n"] == 3 and len(report["items"]) == 3
    assert report["context_tokens"] == 0
    in_file = hd.run_headers(model_dir, built, n=3, max_tokens=4, context_tokens=64)
    assert in_file["context_tokens"] == 64 and [it["header"] for it in in_file["items"]] == [
        it["header"] for it in report["items"]
    ]
    assert report["parsed"] == sum(it["parses"] for it in report["items"])
    assert [it["path"] for it in report["items"]] == sorted(HELDOUT)
