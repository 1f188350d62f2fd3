"""The SWA slot a prompt can use, and what it is worth to each replica, for ``RoutedEngineClient``.

With SWA slot sharing (the replicas report their slot server, ``ModelInfo.swa_holder``, and
one SWA directory that is not ``memory``), the routed client (``services.routing.client``)
looks the prompt's anchors up in the directory; this module judges what it found:

* ``usable_slot``: the longest slot the prompt extends, as an engine would take it, and
  the slot servers holding it;
* ``slot_view``: that slot in the ``RequestView``: its position and anchor blocks, the
  replicas that hold it and what fetching it costs the others
  (``router.policy.slot_fetch_tokens`` over the holders' mean host slot size, with
  ``SlotLookupConfig``), so a policy costs each replica's hit with
  ``cached_tokens(m, engine)`` (docs/router.md, "SWA slots").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from costmodel import CostModel
from engine.kvconnector.swa_directory import SlotLocation
from router.policy import RequestView, slot_fetch_tokens
from services.api.engine_client import EngineClient, ModelInfo
from services.routing.config import SlotLookupConfig


def usable_slot(
    found: Iterable[SlotLocation], anchors: Sequence[bytes], prompt: Sequence[int], block_size: int
) -> tuple[int, int, frozenset[str]] | None:
    """The longest slot of ``found`` that ``prompt`` extends, as an engine would take it
    (``SlotSharing.find``): its anchor is one of ``anchors`` (``ROOT_HASH`` then the prompt's
    block hashes, so the anchor at index k closes k blocks), its tail is shorter than a block
    and equals the prompt's tokens after the anchor, and its position is before the prompt's
    last token. (position, anchor blocks, holders of that slot), or None."""
    index = {bytes(a): k for k, a in enumerate(anchors)}
    best: tuple[int, int, bytes, tuple[int, ...]] | None = None
    holders: set[str] = set()
    for loc in found:
        k = index.get(bytes(loc.anchor))
        if k is None or len(loc.tail) >= block_size:
            continue
        start = k * block_size
        n = start + len(loc.tail)
        if not 0 < n <= len(prompt) - 1 or tuple(prompt[start:n]) != loc.tail:
            continue
        if best is not None and (best[2], best[3]) == (bytes(loc.anchor), loc.tail):
            holders.add(loc.holder)
        elif best is None or n > best[0]:
            best, holders = (n, k, bytes(loc.anchor), loc.tail), {loc.holder}
    return None if best is None else (best[0], best[1], frozenset(holders))


def slot_view(
    view: RequestView,
    slot: tuple[int, int, frozenset[str]],
    infos: Sequence[ModelInfo],
    replicas: Sequence[EngineClient],
    cost: CostModel,
    cfg: SlotLookupConfig,
) -> RequestView:
    """``view`` with ``slot`` (``usable_slot``'s answer) for a policy to cost: its holders as
    replica indices (``infos[k].swa_holder`` names replica k's slot server) and what fetching
    it costs a replica that does not hold it, in tokens (all of them when no replica reports
    its slot size)."""
    position, blocks, holders = slot
    index = {i.swa_holder: k for k, i in enumerate(infos) if i.swa_holder is not None}
    mine = frozenset(index[h] for h in holders if h in index)
    fetch = position  # slot size unknown: another engine's fetch is costed as saving nothing
    slot_bytes = _slot_bytes(replicas, mine)
    if slot_bytes is not None:
        fetch = slot_fetch_tokens(cost, position, slot_bytes, cfg.bytes_per_s, cfg.round_trip_s)
    return replace(
        view,
        swa_slot_tokens=position,
        swa_slot_blocks=blocks,
        swa_slot_holders=mine,
        swa_fetch_tokens=fetch,
        swa_slot_replay=max((i.swa_slot_replay for i in infos if i.swa_holder), default=0),
    )


def _slot_bytes(replicas: Sequence[EngineClient], holders: Iterable[int]) -> float | None:
    """Mean bytes of one host slot (what a fetch moves), from the holders' host pools,
    else any replica's; None when no replica holds a slot."""
    for group in (list(holders), range(len(replicas))):
        sizes = []
        for k in group:
            extra = replicas[k].stats().extra
            if extra.get("host_swa_slots", 0.0) > 0:
                sizes.append(extra["host_swa_bytes"] / extra["host_swa_slots"])
        if sizes:
            return sum(sizes) / len(sizes)
    return None
