"""``Announcements``: a count of changes announced from a worker thread, that asyncio code
waits on without polling.

The engine thread of ``InProcessEngineClient`` announces each change of its published stats
or cache events; a watcher on the event loop (``EngineActor.watch``) sleeps until the count
passes the value it last saw. Each waiter keeps its own count, so every waiter wakes on a
change, and at most one wake-up is queued on the loop at a time however often the thread
announces (every step, while the engine runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Announcements:
    def __init__(self) -> None:
        self.count = 0  # changes announced so far (read and written on the loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None  # set, and replaced, at each announcement
        self._pending = threading.Event()  # a wake-up is queued on the loop

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver announcements to ``loop`` (call on it, before any ``announce``)."""
        self._loop, self._event = loop, asyncio.Event()

    def announce(self) -> None:
        """From any thread: count one change and wake the waiters (no-op before ``bind``)."""
        loop = self._loop
        if loop is None or self._pending.is_set():
            return
        self._pending.set()

        def wake() -> None:
            self._pending.clear()
            self.count += 1
            woken, self._event = self._event, asyncio.Event()
            if woken is not None:
                woken.set()

        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
            loop.call_soon_threadsafe(wake)

    async def wait(self, seen: int, timeout_s: float) -> int:
        """The count, once it differs from ``seen`` (what this returned before; 0 at first) or
        after ``timeout_s``."""
        if self.count != seen:
            return self.count
        event = self._event
        if event is None:  # not bound: nothing will announce
            await asyncio.sleep(timeout_s)
            return self.count
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return self.count
