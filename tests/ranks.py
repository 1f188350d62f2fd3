"""Process groups in tests: each rank a spawned process, the ranks meeting through a
rendezvous file (`engine.distributed.rendezvous`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 240.0) -> None:
    """Run ``target(rank, rendezvous_path, *args)`` in ``world`` spawned processes, and fail
    unless each exits 0 within ``timeout_s`` (a process still running then is killed)."""
    from engine.distributed.rendezvous import rendezvous_file

    ctx = mp.get_context("spawn")
    store = rendezvous_file()  # held until every rank is done
    try:
        procs = [ctx.Process(target=target, args=(r, store.path, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        store.close()
    assert codes == [0] * world, f"the ranks exited with {codes}"
