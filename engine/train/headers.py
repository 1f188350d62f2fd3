"""Greedy continuations of held-out function headers, read back as Python.

The check (issue 15): take 20 function headers from the ``heldout-v1`` files, let a model
continue each one greedily, cut the header plus continuation at the first blank line and
count how many of the 20 parse with ``ast``. The target is at least 10 of 20.

Texts. The held-out files are decoded from ``heldout.bin`` by ``data.json``'s per-file
``offset``/``n_tokens`` (each file's closing EOS dropped) with the data directory's
``tokenizer.json``, and each text is checked against ``manifest.json``'s sha256 for its path,
so the headers come from exactly the held-out bytes (``heldout_texts``).

Candidates. Every module-level (column 0) ``def`` or ``async def`` found by ``ast`` whose
body starts on a later line than the signature. Its header is the source from the ``def``
line (decorators excluded) through the line holding the signature's closing ``:``; that
line must end right after the colon (a header with a trailing comment is skipped), so every
header ends with ``":\\n"`` and is the whole signature. Headers over 400 characters and
headers containing a blank line (which the cut would split) are skipped.

Selection (``select_headers``). Within each file, candidates are ordered by
``sha256(f"{path}:{name}:{lineno}")``; then files, sorted by path, give one candidate each
per round until ``n`` are chosen. The choice is deterministic and spreads the headers over
as many held-out files as possible; fewer than ``n`` candidates is an error.

Generation (``continue_headers``). The prompt is BOS followed by the header's ids (the
model's ``tokenizer.json``, no special tokens added), sampled greedily
(``temperature=0``) for at most ``max_tokens`` tokens; the text leaves control tokens out.
With ``context_tokens`` > 0 the header is continued in its file, as a code-completion
request sends it: the prompt is BOS, then the file's text before the header (its last
``context_tokens`` tokens, from the first line that starts within them), then the header,
encoded together. Only the header and its continuation are read.

Reading (``cut_at_blank_line``). The header plus continuation is cut before its first
blank line outside a string literal (a line that is empty or whitespace only; lines end at
``\\n``, ``\\r\\n`` or ``\\r``, as for the Python tokenizer, which decides what is inside a
string). A blank line inside a docstring belongs to the string: PEP 257 docstrings put one
after their summary line, and cutting there would judge the code by half a string literal.
With no such blank line the whole text is kept. The item parses iff ``ast.parse`` accepts
the cut.

``sluice train headers --model DIR --data DIR`` runs it (``--markdown FILE`` writes the
section that ``docs/training.md`` shows, ``--json`` prints the report).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.train.data import read_array

DEFAULT_N = 20
DEFAULT_MAX_TOKENS = 96
MAX_HEADER_CHARS = 400
TARGET_PARSED = 10  # of 20: the bar


class HeldoutMismatch(ValueError):
    """A decoded held-out text is not the manifest's file."""


@dataclass(frozen=True)
class Header:
    path: str  # relative path of the held-out file
    name: str  # the function's name
    lineno: int  # 1-based line of the ``def`` (or ``async def``)
    text: str  # the signature lines, ending with ":\n"
    before: str = ""  # the file's text before the header's first line (its context)


@dataclass(frozen=True)
class Continuation:
    header: Header
    continuation: str  # the generated text
    cut: str  # header.text + continuation, cut before the first blank line
    parses: bool  # ast.parse(cut) succeeds
    error: str | None  # the SyntaxError, when it does not
    finish_reason: str = ""  # the engine's: "stop" (EOS) or "length" (max_tokens)


# -- held-out texts ----------------------------------------------------------------------
def heldout_texts(data_dir: Path | str) -> dict[str, str]:
    """Every held-out file's text, decoded from ``heldout.bin``, by path in data.json order.

    Raises ``HeldoutMismatch`` if a file does not end with EOS or its decoded text's sha256
    differs from the manifest's."""
    from tokenizers import Tokenizer

    data_dir = Path(data_dir)
    header = json.loads((data_dir / "data.json").read_text(encoding="utf-8"))
    manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
    sha_by_path = {f["path"]: f["sha256"] for f in manifest["files"]}
    tok = Tokenizer.from_file(str(data_dir / header["tokenizer"]["file"]))
    eos = int(header["tokenizer"]["eos"])
    ids = read_array(data_dir, "heldout")
    texts: dict[str, str] = {}
    for entry in header["arrays"]["heldout"]["files"]:
        path, off, n = entry["path"], int(entry["offset"]), int(entry["n_tokens"])
        span = ids[off : off + n]
        if len(span) != n or n < 1 or int(span[-1]) != eos:
            raise HeldoutMismatch(
                f"{data_dir / 'heldout.bin'}: {path} (offset {off}, {n} tokens) does not end with EOS id {eos}"
            )
        text = tok.decode([int(t) for t in span[:-1]], skip_special_tokens=False)
        want = sha_by_path.get(path)
        got = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if got != want:
            raise HeldoutMismatch(
                f"{data_dir}: held-out file {path} decodes to sha256 {got[:16]}..., "
                f"the manifest has {want[:16] + '...' if want else 'no such file'}"
            )
        texts[path] = text
    return texts


# -- headers -----------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    """Lines with their ends, split at ``\\n``, ``\\r\\n`` and ``\\r`` (as ``ast`` counts them)."""
    return io.StringIO(text, newline="").readlines()


def _is_blank(line: str) -> bool:
    return not line.strip()


def _signature_end(lines: list[str], start: int) -> int | None:
    """0-based index of the line holding the ``:`` that closes the signature starting at
    ``lines[start]``: the first ``:`` outside brackets."""
    readline = iter(lines[start:]).__next__
    depth = 0
    try:
        for tok in tokenize.generate_tokens(readline):
            if tok.type != tokenize.OP:
                continue
            if tok.string in ("(", "[", "{"):
                depth += 1
            elif tok.string in (")", "]", "}"):
                depth -= 1
            elif tok.string == ":" and depth == 0:
                return start + tok.start[0] - 1
    except (tokenize.TokenError, SyntaxError, StopIteration):
        return None
    return None


def file_headers(path: str, text: str) -> list[Header]:
    """The candidate headers of one file, in source order (see the module docstring)."""
    tree = ast.parse(text)
    lines = _lines(text)
    out: list[Header] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.col_offset != 0:
            continue
        first = node.lineno - 1
        end = _signature_end(lines, first)
        if end is None or end + 1 >= node.body[0].lineno:  # body on the signature's line
            continue
        head = "".join(lines[first : end + 1])
        if not head.endswith(":\n") or len(head) > MAX_HEADER_CHARS:
            continue
        if any(_is_blank(line) for line in _lines(head)):
            continue
        out.append(Header(path, node.name, node.lineno, head, "".join(lines[:first])))
    return out


def _order_key(h: Header) -> str:
    return hashlib.sha256(f"{h.path}:{h.name}:{h.lineno}".encode()).hexdigest()


def select_headers(texts: dict[str, str], n: int = DEFAULT_N) -> list[Header]:
    """``n`` headers: per file in sha256 order, one per file per round, files by path."""
    queues = [sorted(file_headers(p, texts[p]), key=_order_key) for p in sorted(texts)]
    total = sum(len(q) for q in queues)
    if total < n:
        raise ValueError(f"{total} candidate headers in {len(texts)} held-out files, fewer than n={n}")
    chosen: list[Header] = []
    rnd = 0
    while len(chosen) < n:
        for q in queues:
            if rnd < len(q) and len(chosen) < n:
                chosen.append(q[rnd])
        rnd += 1
    return chosen


# -- reading a continuation --------------------------------------------------------------
def cut_at_blank_line(text: str) -> str:
    """``text`` up to (not including) its first blank line outside a string literal; all of it if none.

    A blank line inside a string is part of the string, not a break in the code: PEP 257
    docstrings put one after their summary line. Python's own tokenizer decides which lines are
    code (it emits a blank-line NL token only outside strings); text it cannot tokenize past (an
    unterminated string or bracket at the end of a truncated generation) has no further cut.
    """
    lines = _lines(text)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text, newline="").readline):
            if tok.type == tokenize.NL and _is_blank(tok.line):
                return "".join(lines[: tok.start[0] - 1])
    except (tokenize.TokenError, SyntaxError):
        return text
    if lines and _is_blank(lines[-1]):  # a whitespace-only last line (no NL token at the end of input)
        return "".join(lines[:-1])
    return text


def parse_error(source: str) -> str | None:
    """None if ``ast.parse`` accepts ``source``, else its error."""
    try:
        ast.parse(source)
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except ValueError as e:  # e.g. NUL bytes on some Python versions
        return f"{type(e).__name__}: {e}"
    return None


def read_continuation(header: Header, continuation: str, finish_reason: str = "") -> Continuation:
    cut = cut_at_blank_line(header.text + continuation)
    error = parse_error(cut)
    return Continuation(header, continuation, cut, error is None, error, finish_reason)


# -- generation --------------------------------------------------------------------------
def continue_headers(
    model_dir: Path | str,
    headers: Sequence[Header],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    device: str = "cpu",
    context_tokens: int = 0,
) -> list[Continuation]:
    """Greedy continuations of ``headers`` by the checkpoint in ``model_dir``, one engine for
    all; ``context_tokens``: how much of each header's file before it the prompt carries."""
    from tokenizers import Tokenizer

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams
    from engine.scheduler.config import SchedulerConfig

    if not headers:
        return []
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    bos = int(config["bos_token_id"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [
        [bos, *tok.encode(file_context(tok, h.before, context_tokens) + h.text, add_special_tokens=False).ids]
        for h in headers
    ]
    seqs = min(8, len(prompts))
    per_seq = math.ceil((max(len(p) for p in prompts) + max_tokens) / SchedulerConfig.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with LLM(
        model_dir, device=device, num_blocks=seqs * per_seq + 1, num_swa_slots=seqs, max_num_seqs=seqs
    ) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [
        read_continuation(h, o.outputs[0].text, o.outputs[0].finish_reason)
        for h, o in zip(headers, outs, strict=True)
    ]


def file_context(tok: Any, before: str, tokens: int) -> str:
    """The end of ``before`` that fits in ``tokens`` tokens of ``tok``, from the first line
    that starts within them ("" when ``tokens`` is 0)."""
    if tokens <= 0 or not before:
        return ""
    enc = tok.encode(before, add_special_tokens=False)
    if len(enc.ids) <= tokens:
        return before
    start = enc.offsets[len(enc.ids) - tokens][0]
    line = before.rfind("\n", 0, start) + 1  # the line the cut falls in starts here
    if line < start:  # a partial line: begin at the next one
        nxt = before.find("\n", start)
        return "" if nxt < 0 else before[nxt + 1 :]
    return before[start:]


# -- reporting ---------------------------------------------------------------------------
def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def render_markdown(conts: Sequence[Continuation]) -> str:
    """A markdown section: the count that parse, then each cut text as a python block."""
    parsed = sum(c.parses for c in conts)
    out = [
        f"**{parsed} of {len(conts)} parse** with `ast` once cut at the first blank line outside a string "
        f"(target: at least {TARGET_PARSED} of 20).",
        "",
    ]
    for c in conts:
        h = c.header
        n_head = len(_lines(h.text))
        gen = len(_lines(c.cut)) - n_head
        verdict = "parses" if c.parses else f"does not parse ({c.error})"
        fence = _fence(c.cut)
        out += [
            f"### {h.path}: {h.name}",
            "",
            f"{verdict}. Header: line {h.lineno} of `{h.path}`, {n_head} line{'s' * (n_head != 1)}; "
            f"then {max(gen, 0)} generated line{'s' * (gen != 1)} before the cut"
            + (f" (generation ended: {c.finish_reason})" if c.finish_reason else "")
            + ".",
            "",
            f"{fence}python",
            c.cut + ("" if c.cut.endswith("\n") else "\n") + fence,
            "",
        ]
    return "\n".join(out)


def run_headers(
    model_dir: Path | str,
    data_dir: Path | str,
    n: int = DEFAULT_N,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    device: str = "cpu",
    context_tokens: int = 0,
) -> dict[str, Any]:
    """Select ``n`` held-out headers from ``data_dir``, continue them with ``model_dir``; a JSON report."""
    headers = select_headers(heldout_texts(data_dir), n)
    conts = continue_headers(
        model_dir, headers, max_tokens=max_tokens, device=device, context_tokens=context_tokens
    )
    return {
        "n": len(conts),
        "parsed": sum(c.parses for c in conts),
        "max_tokens": max_tokens,
        "context_tokens": context_tokens,
        "model_dir": str(model_dir),
        "data_dir": str(data_dir),
        "items": [
            {
                "path": c.header.path,
                "name": c.header.name,
                "lineno": c.header.lineno,
                "header": c.header.text,
                "continuation": c.continuation,
                "cut": c.cut,
                "parses": c.parses,
                "error": c.error,
                "finish_reason": c.finish_reason,
            }
            for c in conts
        ],
    }


def continuations(report: dict[str, Any]) -> list[Continuation]:
    """The `Continuation`s of a `run_headers` report."""
    return [
        Continuation(
            Header(it["path"], it["name"], it["lineno"], it["header"]),
            it["continuation"],
            it["cut"],
            it["parses"],
            it["error"],
            it["finish_reason"],
        )
        for it in report["items"]
    ]
