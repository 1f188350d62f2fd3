"""Per-request cache operations over the block manager and the SWA slot manager (pure).

``match`` finds what an admitted request can skip: either an exact retained slot state
(full blocks + its partial block, no replay) or a run of cached full blocks whose window
state is rebuilt by replaying the last ``swa_replay_tokens`` tokens of the hit (exact), or
only ``bounded_replay_tokens`` of them for a request that opts into bounded replay.

A bounded replay is approximate: from the hit on, the request's state is marked
(``Request.approximate_from``) and nothing computed from it is published: no block is
registered (so no prefix hit, cache event or store write comes from it) and its slot is not
retained at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler.block_manager import BlockManager, OutOfBlocks
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.hashing import ROOT_HASH, BlockHasher
from engine.scheduler.host_slots import HostSlot, HostSlotPool
from engine.scheduler.output import SlotSave
from engine.scheduler.request import Request
from engine.scheduler.swa_slots import RetainedSlot, SwaSlotManager


@dataclass(frozen=True)
class PrefixMatch:
    blocks: tuple[int, ...]  # shared full blocks (plus an adopted partial block if any)
    hit_tokens: int  # compressed cache valid up to here
    replay_tokens: int  # tokens before hit_tokens to recompute for the window state
    slot_entry: RetainedSlot | None  # exact retained state to adopt (then replay_tokens == 0)
    approximate: bool = False  # a bounded replay: fewer tokens than an exact rebuild needs
    host_entry: HostSlot | None = None  # state to load from the host slot pool
    # > 0: the host slot keeps only these first layers; the others are rebuilt by replaying
    # replay_tokens (bounded) with those layers' exact windows kept
    keep_layers: int = 0

    @property
    def start(self) -> int:
        return self.hit_tokens - self.replay_tokens


class CacheManager:
    def __init__(self, config: SchedulerConfig, host_slots: HostSlotPool | None = None) -> None:
        self.config = config
        self.host = host_slots  # slots of ended turns in host memory (None: off)
        self.host_saves: list[SlotSave] = []  # retained slots to copy there (next step)
        # KV connector loads for the next non-empty step (the scheduler's lists): host-slot
        # hits queue their slot and partial block here
        self.kv_loads: list[tuple[int, bytes]] = []
        self.slot_loads: list[tuple[int, bytes]] = []
        self.bs = config.block_size
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.cache_event_capacity
        )
        self.slots = SwaSlotManager(config.num_swa_slots)
        # Newly published blocks to snapshot for the store (KV connector write-through), each
        # pinned with one reference until the step that carries it has run.
        self.pending_saves: list[tuple[int, bytes, str]] = []
        # Admissions that rebuilt a missing window state, by kind (metrics), and the tokens
        # they replayed. A retained slot adopted instead counts in ``slots.reused``.
        self.replays = {"exact": 0, "bounded": 0}
        self.replayed_tokens = {"exact": 0, "bounded": 0}
        self.host_hits = 0  # admissions that loaded their window state from the host pool

    def hasher_for(self, req: Request) -> BlockHasher:
        if req.hasher is None:
            req.hasher = BlockHasher(self.bs, req.extra_keys, req.images)
        return req.hasher

    def match(self, req: Request) -> PrefixMatch:
        """Longest exact reuse for ``req`` (at least one token is always left to compute)."""
        tokens = req.all_token_ids
        max_hit = len(tokens) - 1
        hashes = self.hasher_for(req).update(tokens)
        cached = self.blocks.lookup(hashes[: max_hit // self.bs])
        entry = None
        anchors = [ROOT_HASH, *hashes[: len(cached)]]
        if self.config.enable_prefix_caching:
            entry = self.slots.match(anchors, tokens, self.bs, max_hit)
        hit = len(cached) * self.bs
        replay = min(self.config.swa_replay_tokens, hit)
        if self.config.swa_miss_policy == "recompute" or replay == hit:
            hit, replay = 0, 0
        # A retained slot is exact: it wins whenever it saves as much as an exact rebuild would.
        if entry is not None and max_hit - entry.num_tokens <= max_hit - hit + replay:
            full = entry.num_tokens // self.bs
            blocks = tuple(cached[:full]) + (
                (entry.partial_block,) if entry.partial_block is not None else ()
            )
            return PrefixMatch(blocks, entry.num_tokens, 0, entry)
        # Then the host pool (looked up only when the device has no slot as good).
        pool = self.host if self.config.enable_prefix_caching else None
        host = pool.match(anchors, tokens, self.bs, max_hit) if pool is not None else None
        bounded = min(self.config.bounded_replay_tokens, hit)
        if pool is not None and host is not None and (not pool.lossy or self.wants_bounded(req)):
            # a lossy slot (MXFP8, or not every layer) is approximate state; one that keeps
            # only the first layers also replays (bounded) to rebuild the others
            again = min(self.config.bounded_replay_tokens, host.num_tokens) if pool.layers else 0
            best_other = hit - (bounded if self.wants_bounded(req) else replay)
            if host.num_tokens > again and host.num_tokens - again >= best_other:
                blocks = tuple(cached[: host.num_tokens // self.bs])
                return PrefixMatch(blocks, host.num_tokens, again, None, pool.lossy, host, pool.layers or 0)
        if self.wants_bounded(req) and bounded < replay:
            return PrefixMatch(tuple(cached[: hit // self.bs]), hit, bounded, None, approximate=True)
        return PrefixMatch(tuple(cached[: hit // self.bs]), hit, replay, None)

    def wants_bounded(self, req: Request) -> bool:
        if self.config.bounded_replay_tokens == 0:
            return False
        if req.swa_replay is None:
            return self.config.bounded_replay
        return req.swa_replay == "bounded"

    def can_admit(self, m: PrefixMatch, end_pos: int) -> bool:
        need = self.blocks_needed(end_pos) - len(m.blocks)
        idle_hits = sum(1 for b in m.blocks if self.blocks.ref_count(b) == 0)
        has_slot = m.slot_entry is not None or self.slots.num_available > 0
        releasable = self.slots.num_retained_partials - (
            1 if m.slot_entry is not None and m.slot_entry.partial_block is not None else 0
        )
        return has_slot and need <= self.blocks.num_available - idle_hits + releasable

    def admit(self, req: Request, m: PrefixMatch) -> bool:
        """Give ``req`` its slot and hit blocks; False (nothing changed) when no slot is left.
        The blocks pinned for it while it waited are released once its own references hold."""
        try:
            return self._admit(req, m)
        finally:
            self.unpin(req)

    def unpin(self, req: Request) -> None:
        """Release the references ``req`` held on its prefix while waiting."""
        pinned, req.pinned_blocks = req.pinned_blocks, []
        self.blocks.release(pinned)

    def _admit(self, req: Request, m: PrefixMatch) -> bool:
        if m.slot_entry is not None:
            req.swa_slot = self.slots.take(m.slot_entry)
            shared = m.blocks[:-1] if m.slot_entry.partial_block is not None else m.blocks
            self.blocks.acquire(shared)  # the partial block's reference moves with the slot
            reset = False
        elif m.host_entry is not None:
            if not self._load_host_slot(req, m):
                return False
            reset = False
        else:
            if self.slots.num_available == 0:
                return False
            self.blocks.acquire(m.blocks)  # before evicting: keeps the hit off the LRU
            slot, evicted = self.slots.allocate()
            if evicted is not None and evicted.partial_block is not None:
                self.blocks.release([evicted.partial_block])
            req.swa_slot = slot
            reset = True
        if m.host_entry is None:
            req.block_table = list(m.blocks)
        req.num_computed = m.start
        req.replay_until = m.hit_tokens
        # a fresh slot, or one whose unkept layers are replayed: windows start at the replay
        req.window_from = m.start if reset or m.keep_layers else 0
        req.swa_keep = (m.keep_layers, m.hit_tokens) if m.keep_layers else (0, 0)
        req.num_registered = m.hit_tokens // self.bs
        # Each admission rebuilds the state from cached tokens, so only this one decides.
        req.approximate_from = m.hit_tokens if m.approximate else None
        req.bounded_replays += int(m.approximate)
        if m.replay_tokens:
            kind = "bounded" if m.approximate else "exact"
            self.replays[kind] += 1
            self.replayed_tokens[kind] += m.replay_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = m.start
        return reset

    def _load_host_slot(self, req: Request, m: PrefixMatch) -> bool:
        """A fresh slot and, for a tail, a fresh block, with their loads queued for the next
        step; False (nothing changed) when no slot is left."""
        entry = m.host_entry
        assert entry is not None  # internal invariant: called for host matches only
        if self.slots.num_available == 0 or not self.make_room(int(entry.tail_payload is not None)):
            return False
        self.blocks.acquire(m.blocks)
        slot, evicted = self.slots.allocate()
        if evicted is not None and evicted.partial_block is not None:
            self.blocks.release([evicted.partial_block])
        req.swa_slot, req.block_table = slot, list(m.blocks)
        self.slot_loads.append((slot, entry.slot_payload))
        if entry.tail_payload is not None:
            (block,) = self.blocks.allocate(1)
            req.block_table.append(block)
            self.kv_loads.append((block, entry.tail_payload))
        self.host_hits += 1
        return True

    def blocks_needed(self, end_pos: int) -> int:
        return -(-end_pos // self.bs)

    def make_room(self, need: int) -> bool:
        """Drop retained slots (oldest first) until ``need`` blocks are available."""
        while need > self.blocks.num_available:
            evicted = self.slots.evict_oldest()
            if evicted is None:
                return False
            if evicted.partial_block is not None:
                self.blocks.release([evicted.partial_block])
            self.slots.free(evicted.slot)
        return True

    def grow(self, req: Request, end_pos: int) -> bool:
        """Extend ``req``'s block table to cover ``end_pos``; False if the pool is short."""
        need = self.blocks_needed(end_pos) - len(req.block_table)
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        try:
            req.block_table.extend(self.blocks.allocate(need))
        except OutOfBlocks:  # pragma: no cover - guarded by make_room
            return False
        return True

    def fork(self, parent: Request, child: Request) -> tuple[tuple[int, int] | None, tuple[int, int]] | None:
        """Give ``child`` the parent's state at ``parent.num_computed``: shared full blocks, a
        copy of the partial block and of the slot. Returns (block copy, slot copy) for the
        runner, or None (nothing changed) when no slot or block is left."""
        pos, full = parent.num_computed, parent.num_computed // self.bs
        partial = pos % self.bs != 0
        if self.slots.num_available == 0 or not self.make_room(int(partial)):
            return None
        slot, evicted = self.slots.allocate()
        if evicted is not None and evicted.partial_block is not None:
            self.blocks.release([evicted.partial_block])
        assert parent.swa_slot is not None  # internal invariant: a running parent owns a slot
        shared = parent.block_table[:full]
        self.blocks.acquire(shared)
        table = list(shared)
        block_copy = None
        if partial:
            (new,) = self.blocks.allocate(1)
            block_copy = (parent.block_table[full], new)
            table.append(new)
        child.block_table, child.swa_slot = table, slot
        child.num_computed, child.replay_until, child.window_from = pos, 0, 0
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        child.approximate_from, child.bounded_replays = parent.approximate_from, parent.bounded_replays
        return block_copy, (parent.swa_slot, slot)

    def register_full_blocks(self, req: Request) -> None:
        """Publish every block whose tokens are all known and computed (none after a bounded
        replay: its blocks are approximate)."""
        if req.approximate_from is not None:
            return
        full = min(req.num_computed, req.num_tokens) // self.bs
        if full <= req.num_registered:
            return
        hashes = self.hasher_for(req).update(req.all_token_ids)
        for i in range(req.num_registered, full):
            block = req.block_table[i]
            if self.blocks.register(block, hashes[i]) and self.config.save_new_blocks:
                self.blocks.acquire([block])  # pinned until its snapshot is taken
                self.pending_saves.append((block, hashes[i], req.traffic_class))
        req.num_registered = full

    def free(self, req: Request, retain_slot: bool) -> None:
        """Release ``req``'s blocks and slot; keep the slot (and partial block) for reuse if its
        state is at a fully known position."""
        table, slot = req.block_table, req.swa_slot
        req.block_table, req.swa_slot = [], None
        if slot is None:
            self.blocks.release(table)
            return
        self.register_full_blocks_of(req, table)
        pos = req.num_computed
        keep = (
            retain_slot
            and req.approximate_from is None
            and self.config.enable_prefix_caching
            and req.num_pending == 0
            and pos <= req.num_tokens
            and pos >= req.replay_until
            and pos > 0
        )
        if not keep:
            self.blocks.release(table)
            self.slots.free(slot)
            return
        full = pos // self.bs
        partial = table[full] if pos % self.bs else None
        self.blocks.release(table[:full] + table[full + 1 :] if partial is not None else table)
        hashes = self.hasher_for(req).update(req.all_token_ids)
        anchor = hashes[full - 1] if full else ROOT_HASH
        tail = tuple(req.all_token_ids[full * self.bs : pos])
        self.slots.retain(RetainedSlot(slot, anchor, pos, tail, partial))
        if self.host is not None:  # the turn ended: keep its state past the device's slots
            self.host_saves.append(SlotSave(slot, partial, anchor, pos, tail))

    def register_full_blocks_of(self, req: Request, table: list[int]) -> None:
        saved = req.block_table
        req.block_table = table
        self.register_full_blocks(req)
        req.block_table = saved
