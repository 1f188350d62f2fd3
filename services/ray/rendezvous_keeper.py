"""The actor that keeps an EP group's rendezvous keys (``RendezvousActor``), and
``start_rendezvous``. This module imports no torch: Ray imports an actor's module in the
worker it starts, and the keeper's worker should be up in about a second, not after
torch's import, while the group's ranks wait on it (``services.ray.rendezvous``)."""

from __future__ import annotations

import asyncio
from typing import Any


class RendezvousActor:
    """The key-value state of one group's store, with blocking reads (asyncio actor)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.changed = asyncio.Condition()

    async def set(self, key: str, value: bytes) -> None:
        async with self.changed:
            self.data[key] = bytes(value)
            self.changed.notify_all()

    async def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value, once some rank has set it; None after ``timeout_s``."""
        if not await self.wait([key], timeout_s):
            return None
        return self.data[key]

    async def add(self, key: str, amount: int) -> int:
        async with self.changed:
            value = int(self.data.get(key, b"0")) + int(amount)
            self.data[key] = str(value).encode()
            self.changed.notify_all()
            return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        async with self.changed:
            current = self.data.get(key)
            if (current is None and expected == b"") or current == expected:
                self.data[key] = bytes(desired)
                self.changed.notify_all()
                return bytes(desired)
            return current if current is not None else bytes(expected)

    async def wait(self, keys: list[str], timeout_s: float) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: all(k in self.data for k in keys)), timeout_s
                )
            except TimeoutError:
                return False
            return True

    async def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    async def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    async def size(self) -> int:
        return len(self.data)


def start_rendezvous(name: str) -> Any:
    """A new ``RendezvousActor`` registered as ``name`` (no CPU reserved: it only answers)."""
    import ray

    return ray.remote(RendezvousActor).options(name=name, num_cpus=0, max_concurrency=1000).remote()
