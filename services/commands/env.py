"""``sluice env``: list the SLUICE_ environment variables and validate the current values."""

from __future__ import annotations

import argparse

from services import envs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="list SLUICE_ environment variables and check their current values")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(envs.describe())
    envs.snapshot()  # raises ValueError naming the variable if one is malformed
    return 0
