"""Admission control: at most ``max_concurrency`` requests generate, ``max_queue`` wait.

A request beyond both is refused at once with 429 and ``Retry-After``; a queued request
that does not get a slot within ``queue_timeout_s`` is refused the same way. Refusal costs
a few microseconds (no engine call, no tokenisation), so an overloaded server still
answers fast. Pure asyncio: one instance per event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.api.errors import ApiError


@dataclass
class AdmissionStats:
    running: int = 0
    queued: int = 0
    admitted_total: int = 0
    rejected_full: int = 0
    rejected_timeout: int = 0


class AdmissionController:
    def __init__(
        self, max_concurrency: int, max_queue: int, queue_timeout_s: float, retry_after_s: int
    ) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.stats = AdmissionStats()
        self._waiters: deque[asyncio.Future[None]] = deque()

    def _overloaded(self, why: str) -> ApiError:
        return ApiError(
            429,
            f"server overloaded: {why}; retry after {self.retry_after_s}s",
            param="max_concurrency" if "queue is full" in why else "queue_timeout_s",
            code="overloaded",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def reject_if_full(self) -> None:
        """Raise the 429 now if a new request could neither run nor queue (no await, no parse)."""
        if self.stats.running >= self.max_concurrency and len(self._waiters) >= self.max_queue:
            self.stats.rejected_full += 1
            raise self._overloaded(
                f"{self.stats.running} requests running and the queue is full ({self.max_queue})"
            )

    async def acquire(self) -> None:
        """Take a slot, waiting in FIFO order; raise ``ApiError(429)`` when full or timed out."""
        if self.stats.running < self.max_concurrency and not self._waiters:
            self.stats.running += 1
            self.stats.admitted_total += 1
            return
        if len(self._waiters) >= self.max_queue:
            self.stats.rejected_full += 1
            raise self._overloaded(
                f"{self.stats.running} requests running and the queue is full ({self.max_queue})"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.stats.queued = len(self._waiters)
        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # granted at the last moment: give it back
                self.release()
            self.stats.rejected_timeout += 1
            raise self._overloaded(f"no slot within {time.monotonic() - start:.1f}s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            if not fut.done():
                fut.cancel()
            self.stats.queued = len(self._waiters)
        self.stats.admitted_total += 1

    def release(self) -> None:
        """Hand the slot to the oldest waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; running stays the same
                self.stats.queued = len(self._waiters)
                return
        self.stats.running -= 1
        self.stats.queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
