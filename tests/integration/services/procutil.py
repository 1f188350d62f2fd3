"""Process-tree helpers for the tests that check a command leaves no child behind (Linux /proc)."""

from __future__ import annotations

import time
from pathlib import Path


def children(pid: int) -> set[int]:
    """Direct children of ``pid`` (every thread's), empty once it is gone."""
    out: set[int] = set()
    try:  # the process can exit while its task directory is listed
        tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    except OSError:
        return out
    for f in tasks:
        try:
            out.update(int(x) for x in f.read_text().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> set[int]:
    todo, seen = [pid], set()
    while todo:
        for child in children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: set[int], timeout_s: float = 10.0) -> set[int]:
    """The pids still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {p for p in pids if running(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def command_line(pid: int) -> str:
    """``pid``'s command line ("" when gone, or forked and not yet exec'd into its program)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def command_lines(pids: set[int]) -> list[str]:
    return [c for c in map(command_line, sorted(pids)) if c]
