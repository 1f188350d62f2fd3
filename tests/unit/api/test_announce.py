"""``Announcements``: waiters on the loop wake on changes announced from another thread."""

from __future__ import annotations

import asyncio
import threading

from services.api.announce import Announcements


def test_every_waiter_wakes_on_an_announcement_from_another_thread_and_only_then() -> None:
    async def scenario() -> None:
        a = Announcements()
        assert await a.wait(0, 0.01) == 0  # unbound: a plain sleep
        a.bind(asyncio.get_running_loop())
        assert await a.wait(0, 0.05) == 0  # nothing announced: the timeout
        waiters = [asyncio.create_task(a.wait(0, 30.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters)
        threading.Thread(target=a.announce).start()
        assert await asyncio.gather(*waiters) == [1, 1, 1]
        assert await a.wait(0, 30.0) == 1  # a waiter behind the count returns at once

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_announcements_while_one_is_queued_are_coalesced() -> None:
    async def scenario() -> int:
        a = Announcements()
        a.bind(asyncio.get_running_loop())
        for _ in range(100):  # the loop runs none of them until this coroutine yields
            a.announce()
        return await a.wait(0, 30.0)

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == 1
