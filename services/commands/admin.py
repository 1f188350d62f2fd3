"""``sluice admin``: the operator endpoints of a running server (``services/api/admin.py``).

    sluice admin engines                        # every engine: pool, up, draining, load
    sluice admin drain decode-1 --wait          # drain it; return once it holds nothing
    sluice admin undrain decode-1

The server is ``--url`` (default ``http://127.0.0.1:8000``); the key is the first of
``SLUICE_ADMIN_KEYS``, as the server reads it. ``--wait`` polls ``GET /admin/engines``
every ``--poll-s`` seconds for at most ``--timeout-s`` (exit 1 when it is not drained by
then). Exit 2 on a refused call (the server's message is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from services import envs

DEFAULT_URL = "http://127.0.0.1:8000"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="list the engines of a running server and drain one")
    p.add_argument("action", choices=("engines", "drain", "undrain"))
    p.add_argument("engine", nargs="?", help="the engine's name (drain, undrain), e.g. decode-1")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--wait", action="store_true", help="drain: return once the engine holds nothing")
    p.add_argument("--timeout-s", type=float, default=600.0, help="--wait at most this long (default 600)")
    p.add_argument("--poll-s", type=float, default=1.0, help="--wait polls this often (default 1)")
    p.add_argument("--json", action="store_true", help="print the server's JSON")
    p.set_defaults(func=run)


class Refused(ValueError):
    """The server refused the call (its message says why)."""


def run(args: argparse.Namespace) -> int:
    import httpx

    keys = envs.ADMIN_KEYS.get()
    if not keys:
        raise ValueError("set SLUICE_ADMIN_KEYS to the server's admin key")
    if args.action != "engines" and not args.engine:
        raise ValueError(f"`sluice admin {args.action}` needs the engine's name (see `sluice admin engines`)")
    if args.timeout_s <= 0 or args.poll_s <= 0:
        raise ValueError("--timeout-s and --poll-s must be > 0")
    with httpx.Client(
        base_url=args.url, headers={"Authorization": f"Bearer {keys[0]}"}, timeout=30.0
    ) as http:
        try:
            if args.action == "engines":
                rows = _call(http, "GET", "/admin/engines")["engines"]
                print(json.dumps(rows, indent=1) if args.json else _table(rows))
                return 0
            row = _call(http, "POST", f"/admin/engines/{args.engine}/{args.action}")
            if args.action == "drain" and args.wait:
                row = _wait_drained(http, args.engine, args.timeout_s, args.poll_s)
        except Refused as exc:
            print(f"sluice admin: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(row) if args.json else _table([row]))
    return 0 if args.action != "drain" or not args.wait or row["drained"] else 1


def _call(http: Any, method: str, path: str) -> Any:
    import httpx

    try:
        r = http.request(method, path)
    except httpx.TransportError as exc:
        raise Refused(f"cannot reach {http.base_url}: {exc}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:500]
        raise Refused(f"{method} {path}: {r.status_code}: {message}")
    return r.json()


def _wait_drained(http: Any, name: str, timeout_s: float, poll_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {r["name"]: r for r in _call(http, "GET", "/admin/engines")["engines"]}
        row = rows[name]
        if row["drained"] or time.monotonic() >= deadline:
            return row
        print(f"{name}: {row['running']} running, {row['waiting']} waiting", file=sys.stderr)
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


COLUMNS = ("name", "pool", "host", "pid", "alive", "draining", "drained", "running", "waiting", "kv_tokens")


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [COLUMNS, *[tuple(str(r.get(c, "")) for c in COLUMNS) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)
