"""A rendezvous for an EP group's ranks through Ray itself: ``RayStore``, a
``torch.distributed.Store`` kept by a small actor (``RendezvousActor``).

An EP instance's ranks may sit on several hosts (DeepSeek's decode instance is EP 64 over
8 hosts), so a file on one host cannot be their meeting point, and a ``TCPStore`` server
binds every interface. Ray already connects every process of the cluster: the ranks meet
through an actor of the cluster, over Ray's own channels, and nothing new listens. The
store carries only the rendezvous (a few small keys); the collectives then run over gloo
or NCCL directly between the ranks.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch.distributed as dist


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


class RayStore(dist.Store):
    """The ``Store`` interface over a ``RendezvousActor`` (``handle``); calls block the
    calling thread (a rank joins its group on its engine thread)."""

    def __init__(self, handle: Any, timeout_s: float = 120.0) -> None:
        super().__init__()
        self.handle, self.timeout_s = handle, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout_s + 30.0)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        value = self._call("get", key, self.timeout_s)
        if value is None:
            raise TimeoutError(
                f"rendezvous key {key!r} not set within {self.timeout_s} s: a rank did not arrive"
            )
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        enc = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return bytes(self._call("compare_set", key, *enc))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        if not self._call("wait", list(keys), limit):
            raise TimeoutError(f"rendezvous keys {keys} not set within {limit} s: a rank did not arrive")

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def num_keys(self) -> int:
        return int(self._call("size"))


def start_rendezvous(name: str) -> Any:
    """A new ``RendezvousActor`` registered as ``name`` (no CPU reserved: it only answers)."""
    import ray

    return ray.remote(RendezvousActor).options(name=name, num_cpus=0, max_concurrency=1000).remote()
