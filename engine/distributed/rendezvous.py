"""A rendezvous for process groups started on one host: a ``TCPStore`` that the launching
process serves on a port it binds itself (port 0), which the ranks then join.

The usual ``init_method="tcp://127.0.0.1:PORT"`` with a port picked by ``free_port()`` leaves
a window between the pick and rank 0's bind, in which any other process on the host (a
listener, or an outgoing connection's source port, from the same range) can take the port.
Here the port is bound before any rank starts, and held until the launcher drops the store.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

HOST = "127.0.0.1"


def serve_store(timeout_s: float = 300.0) -> Any:
    """A ``TCPStore`` served by this process on a free loopback port (``.port``). Keep it
    alive until every rank has finished."""
    return dist.TCPStore(
        HOST, 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def join_group(backend: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
    """``init_process_group`` for one rank, through the store a launcher serves on ``port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, None, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
