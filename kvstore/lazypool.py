"""``LazyPool``: a small thread pool started on first use and shut down once.

``StoreClient.get_prefix_async`` runs reads on one, so a caller that must not block (the
engine's scheduler thread) gets a ``Future`` at once, and a client that never reads
asynchronously starts no thread. Pure: no sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class LazyPool:
    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.thread_name_prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the pool; RuntimeError once the pool is shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.thread_name_prefix} pool is shut down (the client is closed)")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix=self.thread_name_prefix)
            return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Cancel what has not started, wait for what has; later submits raise."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
