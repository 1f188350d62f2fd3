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

import datetime
from typing import Any

import torch.distributed as dist

from services.ray.rendezvous_keeper import RendezvousActor, start_rendezvous

__all__ = ["RayStore", "RendezvousActor", "start_rendezvous"]


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
