"""Block groups: packing a chain's consecutive small blocks into one object (pure).

A group is a run of consecutive blocks whose payloads, concatenated, are one erasure-coded
object; each block's directory row names the object and its ``(offset, length)`` inside it.
Coding ~1 MiB at once instead of each 256 KiB block alone cuts the shards a prefix read
handles (and the client's per-shard CPU) by the group's block count.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_groups(sizes: Sequence[int], group_bytes: int) -> list[range]:
    """Split block indices ``0..len(sizes)-1`` into consecutive runs of total size at most
    ``group_bytes``, greedily in order. A block larger than ``group_bytes`` is a run of its
    own, and ``group_bytes == 0`` puts every block in a run of its own (no grouping).
    Every index appears in exactly one run, in order."""
    if group_bytes < 0:
        raise ValueError(f"group_bytes must be >= 0 (0 disables grouping), got {group_bytes}")
    if group_bytes == 0:
        return [range(i, i + 1) for i in range(len(sizes))]
    runs: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"block {i} has a negative size {n}")
        if i > start and total + n > group_bytes:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    if sizes:
        runs.append(range(start, len(sizes)))
    return runs


# One object to write: the key it is placed by, its bytes, and its blocks as (key, offset,
# length) when it is a group of several blocks (None: the object is the block ``key``).
GroupedObject = tuple[bytes, bytes, "list[tuple[bytes, int, int]] | None"]


def group_objects(todo: Sequence[tuple[bytes, bytes]], group_bytes: int) -> list[GroupedObject]:
    """The objects to write for blocks ``todo`` ((key, payload) in chain order): each run of
    ``pack_groups`` is one object, its payloads joined (a run of one is the block itself)."""
    objs: list[GroupedObject] = []
    for run in pack_groups([len(p) for _, p in todo], group_bytes):
        if len(run) == 1:
            key, payload = todo[run[0]]
            objs.append((key, payload, None))
            continue
        members, offset = [], 0
        for i in run:
            members.append((todo[i][0], offset, len(todo[i][1])))
            offset += len(todo[i][1])
        objs.append((todo[run[0]][0], b"".join(todo[i][1] for i in run), members))
    return objs
