"""A simulated device that keeps the scheduler honest (test helper, pure Python).

It models what the real caches hold: one row per (block, offset) with the token and the
rolling digest of the whole prefix up to it, and one state per SWA slot (position and
digest). Every step it *checks* what a real model would silently get wrong: the slot must
sit exactly at the chunk's start, every block row it reads must carry the right prefix,
rows below ``replay_until`` are read and never rewritten. The next token is a function of
the exact prefix digest, so any wrong hit, stale block or lost state changes the outputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from engine.scheduler.output import PENDING_TOKEN, RunnerOutput, SchedulerOutput

ZERO = b"\x00" * 32


def step_digest(prev: bytes, token: int) -> bytes:
    return hashlib.sha256(prev + token.to_bytes(4, "little")).digest()


def next_token(digest: bytes, vocab: int) -> int:
    return int.from_bytes(digest[:4], "little") % vocab


def reference(prompt: list[int], max_tokens: int, vocab: int, stop: frozenset[int]) -> list[int]:
    d = ZERO
    for t in prompt:
        d = step_digest(d, t)
    out: list[int] = []
    while len(out) < max_tokens:
        t = next_token(d, vocab)
        out.append(t)
        if t in stop:
            break
        d = step_digest(d, t)
    return out


@dataclass
class SimDevice:
    block_size: int
    vocab: int = 50
    min_replay: int = 0
    rows: dict[tuple[int, int], tuple[int, bytes]] = field(default_factory=dict)
    slots: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    last_sampled: dict[str, int] = field(default_factory=dict)
    tokens_computed: int = 0
    forked: int = 0  # slot copies applied (n > 1 forks)

    def _row(self, table: tuple[int, ...], pos: int) -> tuple[int, bytes]:
        bs = self.block_size
        key = (table[pos // bs], pos % bs)
        if key not in self.rows:
            raise AssertionError(f"position {pos} (block {key}) was never written")
        return self.rows[key]

    def _check_prefix(self, table: tuple[int, ...], upto: int) -> bytes:
        d = ZERO
        for p in range(upto):
            tok, dig = self._row(table, p)
            d = step_digest(d, tok)
            if dig != d:
                raise AssertionError(f"row at position {p} holds another prefix's state")
        return d

    def _apply_copies(self, out: SchedulerOutput) -> None:
        self.forked += len(out.slot_copies)
        for src, dst in out.block_copies:
            for off in range(self.block_size):
                if (src, off) in self.rows:
                    self.rows[(dst, off)] = self.rows[(src, off)]
                else:
                    self.rows.pop((dst, off), None)
        for src, dst in out.slot_copies:
            self.slots[dst] = self.slots[src]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled: dict[str, int] = {}
        self._apply_copies(out)
        for seq in out.seqs:
            table = seq.block_table
            if seq.reset_slot:
                if seq.start_pos > 0:
                    if seq.replay_until - seq.start_pos < min(self.min_replay, seq.replay_until):
                        raise AssertionError("hit without its slot state and without enough replay")
                    self._check_prefix(table, seq.replay_until)
                self.slots[seq.swa_slot] = (seq.start_pos, self._check_prefix(table, seq.start_pos))
            pos, d = self.slots[seq.swa_slot]
            if pos != seq.start_pos:
                raise AssertionError(f"{seq.request_id}: slot at {pos}, chunk starts at {seq.start_pos}")
            if d != self._check_prefix(table, seq.start_pos):
                raise AssertionError(f"{seq.request_id}: slot state does not match its blocks")
            for i, tok in enumerate(seq.token_ids):
                if tok == PENDING_TOKEN:
                    tok = self.last_sampled[seq.request_id]
                p = seq.start_pos + i
                d = step_digest(d, tok)
                key = (table[p // self.block_size], p % self.block_size)
                if p < seq.replay_until:
                    if self.rows.get(key) != (tok, d):
                        raise AssertionError(f"replayed position {p} disagrees with its cached row")
                else:
                    self.rows[key] = (tok, d)
            self.slots[seq.swa_slot] = (seq.start_pos + seq.num_new, d)
            self.tokens_computed += seq.num_new
            if seq.sample:
                t = next_token(d, self.vocab)
                for rid in (seq.request_id, *seq.fork_children):
                    sampled[rid] = t
                    self.last_sampled[rid] = t
        return RunnerOutput(out.step, sampled)
