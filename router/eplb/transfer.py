"""Weight-move planning for a placement change (pure; the engine executes the plan).

Every rank and the controller compute the same plan from (old, new) phy2log of one layer,
so the plan can also be shipped as plain int arrays (:meth:`RemapPlan.to_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Transfer:
    src_rank: int
    src_local: int  # slot index in the source rank's *old* buffer
    dst_rank: int
    dst_local: int  # slot index in the destination rank's *new* buffer


@dataclass(frozen=True)
class RemapPlan:
    """How one layer's weights move. ``local`` = (rank, old_local, new_local) copies from
    the rank's own old buffer; ``dup`` = (rank, new_local_src, new_local_dst) copies of a
    slot received in this remap; ``transfers`` go over the network, in a fixed order."""

    transfers: tuple[Transfer, ...]
    local: tuple[tuple[int, int, int], ...]
    dup: tuple[tuple[int, int, int], ...]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain int64 arrays (``transfers`` [n, 4], ``local`` and ``dup`` [n, 3]) for
        transport without pickle (msgpack or raw bytes)."""
        return {
            "transfers": np.array(
                [[t.src_rank, t.src_local, t.dst_rank, t.dst_local] for t in self.transfers], dtype=np.int64
            ).reshape(-1, 4),
            "local": np.array(self.local, dtype=np.int64).reshape(-1, 3),
            "dup": np.array(self.dup, dtype=np.int64).reshape(-1, 3),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> RemapPlan:
        def rows(name: str, width: int) -> list[tuple[int, ...]]:
            a = np.asarray(arrays[name], dtype=np.int64)
            if a.ndim != 2 or a.shape[1] != width:
                raise ValueError(f"plan array {name!r} must be [n, {width}], got {a.shape}")
            return [tuple(int(x) for x in r) for r in a]

        return cls(
            tuple(Transfer(*r) for r in rows("transfers", 4)),
            tuple(rows("local", 3)),  # type: ignore[arg-type]
            tuple(rows("dup", 3)),  # type: ignore[arg-type]
        )


def plan_remap(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> RemapPlan:
    """Plan one layer's move (pure; every rank computes the same plan).

    A destination rank that already holds an expert copies it locally; otherwise it
    receives it once (further slots of the same expert are local duplicates) from an old
    holder, chosen as the one that has sent the fewest slots so far (ties: lowest rank).
    """
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 1 or old.size % num_ranks:
        raise ValueError("old and new phy2log must be 1-D, the same length, divisible by num_ranks")
    if set(new.tolist()) - set(old.tolist()):
        raise ValueError("new placement holds experts the old one does not")
    s = old.size // num_ranks
    holders: dict[int, list[int]] = {}
    for slot, e in enumerate(old.tolist()):
        holders.setdefault(e, []).append(slot)
    sent = np.zeros(num_ranks, dtype=np.int64)
    transfers: list[Transfer] = []
    local: list[tuple[int, int, int]] = []
    dup: list[tuple[int, int, int]] = []
    for d in range(num_ranks):
        old_local = {int(e): j for j, e in reversed(list(enumerate(old[d * s : (d + 1) * s])))}
        received: dict[int, int] = {}
        for j, e in enumerate(new[d * s : (d + 1) * s].tolist()):
            if e in old_local:
                local.append((d, old_local[e], j))
            elif e in received:
                dup.append((d, received[e], j))
            else:
                src_slot = min(holders[e], key=lambda q: (sent[q // s], q))
                sent[src_slot // s] += 1
                transfers.append(Transfer(src_slot // s, src_slot % s, d, j))
                received[e] = j
    return RemapPlan(tuple(transfers), tuple(local), tuple(dup))
