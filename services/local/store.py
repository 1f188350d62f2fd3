"""``LocalStore``: a whole KV store on loopback (N store nodes, a Redis directory) and the
spec file that lets other processes use it.

Used by ``sluice store cluster --redis`` and ``sluice serve --store local``. It lives in
``services`` and not in ``kvstore.cluster`` because it starts Redis through
``services.local.procs.RedisProcess`` (the one place that knows redis-server's hardened flags),
and ``kvstore`` does not import ``services``.

Start order: Redis, then the nodes, then the spec file, written atomically only once every
node answers its Health RPC, so a process that sees the file can use the store. ``stop``
removes the file first, then stops the nodes and Redis; a failed start stops what it had
started.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from kvstore.cluster import LocalClusterConfig, LocalStoreCluster
from kvstore.spec import StoreSpec
from services.local.procs import RedisProcess

log = logging.getLogger(__name__)
SPEC_NAME = "store-spec.json"


class LocalStore:
    """Context manager: ``with LocalStore() as store: store.spec_path, store.spec``.

    ``spec_path`` None writes the spec into a temporary directory (removed on stop);
    ``redis=False`` keeps no directory server: with ``directory`` (the URL of a Redis run
    elsewhere) the spec names that one, without it no spec is written (an in-memory
    directory cannot be shared with another process)."""

    def __init__(
        self,
        cluster: LocalClusterConfig | None = None,
        spec_path: Path | None = None,
        root: Path | None = None,
        redis: bool = True,
        directory: str | None = None,
    ) -> None:
        if redis and directory is not None:
            raise ValueError("give a directory URL or start a Redis here, not both")
        if spec_path is not None and not redis and directory is None:
            raise ValueError(
                "a spec file needs a Redis directory: other processes cannot share an in-memory one"
            )
        self.directory = directory
        self.cluster = LocalStoreCluster(cluster or LocalClusterConfig(), root=root)
        self.redis: RedisProcess | None = RedisProcess(host=self.cluster.config.host) if redis else None
        self._tmp: Path | None = None
        self.spec_path: Path | None = spec_path
        self.spec: StoreSpec | None = None
        self._wrote = False

    def start(self) -> LocalStore:
        try:
            if self.redis is not None:
                self.redis.start()
            self.cluster.start()
            directory = self.redis.url if self.redis is not None else self.directory
            if directory is not None:
                self.spec = StoreSpec(nodes=self.cluster.nodes, directory=directory)
                if self.spec_path is None:
                    self._tmp = Path(tempfile.mkdtemp(prefix="sluice-store-spec-"))
                    self.spec_path = self._tmp / SPEC_NAME
                self.spec.save(self.spec_path)
                self._wrote = True
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove the spec file (if this store wrote it), stop the nodes, then Redis."""
        if self._wrote and self.spec_path is not None:
            self.spec_path.unlink(missing_ok=True)
            self._wrote = False
        try:
            self.cluster.stop()
        finally:
            if self.redis is not None:
                self.redis.stop()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def pids(self) -> list[int]:
        """Process ids of the running nodes and Redis."""
        procs = [*self.cluster.procs, self.redis.proc if self.redis is not None else None]
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def __enter__(self) -> LocalStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
