"""A rendezvous for process groups started on one host: a file the ranks meet through.

The launcher makes a ``Rendezvous`` (a fresh private directory; ``.path`` names the file
inside it) and hands the path to every rank; each rank calls ``join_group``, which builds a
``torch.distributed.FileStore`` on it. Nothing listens: a ``TCPStore`` server, the usual
choice, binds every interface whatever host it is given, and a port picked by ``free_port()``
can be taken by another process before rank 0 binds it. The ranks must share the host's
filesystem (they do: they are the launcher's children, or Ray actors of one STRICT_PACK
placement group). Keep the ``Rendezvous`` until every rank has joined; ``close`` (or garbage
collection) removes the directory.
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

import torch.distributed as dist


class Rendezvous:
    """A private directory for one group's store file (``path``)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-rendezvous-")
        self.path = str(Path(self._dir.name) / "store")

    def close(self) -> None:
        self._dir.cleanup()


def rendezvous_file() -> Rendezvous:
    """A new rendezvous for one process group; pass ``.path`` to every rank."""
    return Rendezvous()


def join_group(backend: str, path: str, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
    """``init_process_group`` for one rank, through the rendezvous file at ``path``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
