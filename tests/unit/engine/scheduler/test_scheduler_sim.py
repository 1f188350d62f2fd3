"""The scheduler against a simulated device that checks every cache access.

Each workload's outputs must equal the plain reference (no caching, no chunking), and the
device raises if a chunk starts from a wrong slot state, reads a stale block or rewrites a
cached row. Configurations force many chunks, prefix hits, retained-slot adoption,
preemption and asynchronous scheduling.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.loop import EngineLoop
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler
from tests.unit.engine.scheduler.sim import SimDevice, reference

VOCAB = 50
STOP = frozenset({0})


def make_workload(seed: int, n: int, shared_prefix: int = 40) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        keep = rng.randrange(0, shared_prefix + 1)
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 60))]
        out.append((f"r{i}", base[:keep] + tail, rng.randrange(1, 40)))
    return out


class SimLauncher:
    """The simulated device behind a pipelined loop: ``launch`` only records the step, ``finish``
    executes it. ``follows`` and ``holds`` answer at random (seeded), so the loop meets every
    mix of overlapped and finished-first steps; finishes must come in launch order, and a step
    may follow only an unfinished one."""

    def __init__(self, dev: SimDevice, seed: int) -> None:
        self.dev, self.rng = dev, random.Random(seed)
        self.launched: list[int] = []
        self.finished: list[int] = []
        self.followed = 0
        self._outs: dict[int, object] = {}

    def launch(self, out, prev=None):
        if prev is not None:
            assert prev not in self.finished, "launched after a finished step"
            self.followed += 1
        self.launched.append(out.step)
        self._outs[out.step] = out
        return out.step

    def finish(self, handle):
        assert handle == self.launched[len(self.finished)], "finished out of launch order"
        self.finished.append(handle)
        return self.dev.execute(self._outs.pop(handle))

    def follows(self, out, prev) -> bool:
        return self.rng.random() < 0.8

    def holds(self, handle) -> bool:
        return self.rng.random() < 0.8


def run(cfg: SchedulerConfig, work, async_scheduling=False, priorities=None, min_replay=0, pipelined=False):
    sched = Scheduler(cfg)
    dev = SimDevice(cfg.block_size, VOCAB, min_replay=min_replay)
    for i, (rid, prompt, mx) in enumerate(work):
        prio = priorities[i] if priorities else 0
        sched.add_request(Request(rid, list(prompt), mx, STOP, priority=prio))
    launcher = dev.launcher = SimLauncher(dev, len(work)) if pipelined else None
    loop = EngineLoop(sched, dev.execute, async_scheduling=async_scheduling, launcher=launcher)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, RequestStatus] = {}
    reqs = dict(sched.requests)
    for _ in range(10_000):
        if not loop.has_work():
            break
        upd = loop.step()
        for r in upd.finished:
            outputs[r.request_id] = list(r.output_token_ids)
            reasons[r.request_id] = r.status
    loop.close()
    sched.cache.blocks.check_invariants()
    return outputs, reasons, sched, dev, reqs


def check_against_reference(work, outputs):
    assert set(outputs) == {rid for rid, _, _ in work}, "a request was lost"
    for rid, prompt, mx in work:
        assert outputs[rid] == reference(prompt, mx, VOCAB, STOP), rid


CONFIGS = {
    "roomy": SchedulerConfig(num_blocks=200, num_swa_slots=32, block_size=8, max_num_batched_tokens=64),
    "tiny-chunks": SchedulerConfig(num_blocks=200, num_swa_slots=32, block_size=8, max_num_batched_tokens=7),
    "no-prefix-cache": SchedulerConfig(
        num_blocks=200, num_swa_slots=32, block_size=8, max_num_batched_tokens=32, enable_prefix_caching=False
    ),
    "recompute-policy": SchedulerConfig(
        num_blocks=200, num_swa_slots=32, block_size=8, max_num_batched_tokens=32, swa_miss_policy="recompute"
    ),
    "memory-pressure": SchedulerConfig(
        num_blocks=24, num_swa_slots=6, block_size=8, max_num_batched_tokens=48
    ),
    "batch-invariant": SchedulerConfig(
        num_blocks=200,
        num_swa_slots=32,
        block_size=8,
        max_num_batched_tokens=48,
        batch_invariant=True,
        invariant_chunk_tokens=16,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mode", ["sync", "async", "pipelined"])
def test_outputs_equal_reference(name, mode):
    work = make_workload(seed=len(name), n=24)
    outputs, _, sched, _, _ = run(
        CONFIGS[name], work, mode == "async", min_replay=CONFIGS[name].swa_replay_tokens,
        pipelined=mode == "pipelined",
    )  # fmt: skip
    check_against_reference(work, outputs)
    if name == "memory-pressure":
        assert sched.num_preemptions > 0, "the workload must actually preempt"


def test_prefix_hits_are_counted_and_skip_compute():
    cfg = SchedulerConfig(num_blocks=100, num_swa_slots=8, block_size=8, swa_replay_tokens=8)
    prompt = list(range(1, 41))  # 5 full blocks
    first, _, sched, dev, reqs = run(cfg, [("a", prompt, 3)])
    computed_alone = dev.tokens_computed
    # Same engine, second request with the same prompt: hit of 4 blocks (the last token is
    # always recomputed), replaying 8 tokens because the first request's slot moved on.
    sched.add_request(Request("b", prompt + [7], 3, STOP))
    loop = EngineLoop(sched, dev.execute)
    while loop.has_work():
        loop.step()
    stats = sched.cache.blocks.stats
    assert stats.hit_blocks >= 4 and stats.queries == 2
    assert dev.tokens_computed - computed_alone < len(prompt)  # the hit skipped work


def test_multi_turn_adopts_retained_slot_without_replay():
    cfg = SchedulerConfig(num_blocks=100, num_swa_slots=8, block_size=8, swa_replay_tokens=16)
    sched = Scheduler(cfg)
    dev = SimDevice(8, VOCAB, min_replay=16)
    turn1 = [5] * 21
    sched.add_request(Request("t1", turn1, 4, frozenset()))
    loop = EngineLoop(sched, dev.execute)
    done = []
    while loop.has_work():
        done += loop.step().finished
    history = turn1 + done[0].output_token_ids
    turn2 = history + [9, 9, 9]
    sched.add_request(Request("t2", turn2, 2, frozenset()))
    req2 = sched.requests["t2"]
    before = dev.tokens_computed
    while loop.has_work():
        loop.step()
    # The slot stood at len(history) - 1 (the last output is never computed): only the
    # tail is computed, no replay, and the partial block was adopted.
    assert req2.num_cached_tokens == len(history) - 1
    assert dev.tokens_computed - before == len(turn2) - (len(history) - 1) + 1
    assert sched.cache.slots.reused == 1


def test_priority_orders_admission_and_preemption_victim():
    cfg = SchedulerConfig(num_blocks=6, num_swa_slots=4, block_size=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    sched.add_request(Request("low", [1] * 8, 8, frozenset(), priority=5))
    sched.add_request(Request("high", [2] * 8, 8, frozenset(), priority=0))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["high", "low"]
    dev = SimDevice(4, VOCAB)
    sched.update(out, dev.execute(out))
    # Both need a third block for positions 8..; 6 blocks: 2+2 used, 2 free -> decodes fit
    # until growth runs out, then "low" (lowest priority) is the victim, never "high".
    victims = set()
    for _ in range(20):
        out = sched.schedule()
        victims |= out.preempted_ids
        if out.is_empty:
            break
        sched.update(out, dev.execute(out))
    assert "high" not in victims and "low" in victims


def test_abort_waiting_and_running():
    cfg = SchedulerConfig(num_blocks=50, num_swa_slots=1, block_size=4)
    sched = Scheduler(cfg)
    sched.add_request(Request("a", [1, 2, 3], 10, frozenset()))
    sched.add_request(Request("b", [1, 2, 3], 10, frozenset()))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"]  # one slot only
    assert sched.abort("b") and sched.abort("a") and not sched.abort("zzz")
    assert not sched.has_unfinished()
    nxt = sched.schedule()
    assert nxt.is_empty and nxt.finished_ids == {"a", "b"}
    assert sched.cache.blocks.num_available == 50


def test_priorities_do_not_change_outputs_under_pressure():
    work = make_workload(seed=3, n=16)
    prios = [random.Random(i).randrange(0, 3) for i in range(16)]
    outputs, _, sched, _, _ = run(CONFIGS["memory-pressure"], work, priorities=prios)
    check_against_reference(work, outputs)


def test_async_and_sync_issue_identical_results():
    work = make_workload(seed=11, n=20)
    a = run(CONFIGS["tiny-chunks"], work, async_scheduling=False)[0]
    b = run(CONFIGS["tiny-chunks"], work, async_scheduling=True)[0]
    assert a == b


@pytest.mark.parametrize("seed", range(6))
def test_pipelined_loop_finishes_in_order_whatever_follows_and_holds(seed):
    """Random follows / holds answers: finishes in launch order (SimLauncher asserts it),
    steps really overlapped, and the outputs of the synchronous loop."""
    work = make_workload(seed=seed, n=20)
    want = run(CONFIGS["tiny-chunks"], work)[0]
    got, _, _, dev, _ = run(CONFIGS["tiny-chunks"], work, pipelined=True)
    assert got == want
    assert dev.launcher.followed > 0 and dev.launcher.finished == dev.launcher.launched


def test_request_too_large_for_cache_is_rejected():
    sched = Scheduler(SchedulerConfig(num_blocks=2, num_swa_slots=1, block_size=4))
    with pytest.raises(ValueError, match="cache holds 8"):
        sched.add_request(Request("x", [1] * 6, 5))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_forks_share_the_prompt_and_match_the_reference(async_scheduling):
    cfg = SchedulerConfig(num_blocks=60, num_swa_slots=8, block_size=8, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    dev = SimDevice(8, VOCAB)
    prompt = [3 + (i * 7) % 40 for i in range(37)]  # 4 full blocks + a partial one: copy needed
    sched.add_request(Request("p", prompt, 6, frozenset()))
    for i in (1, 2):
        sched.add_request(Request(f"c{i}", prompt, 6, frozenset(), fork_of="p"))
    loop = EngineLoop(sched, dev.execute, async_scheduling=async_scheduling)
    outs = {}
    while loop.has_work():
        for r in loop.step().finished:
            outs[r.request_id] = r.output_token_ids
    loop.close()
    want = reference(prompt, 6, VOCAB, frozenset())
    assert outs == {"p": want, "c1": want, "c2": want}
    assert dev.forked == 2
    assert dev.tokens_computed == len(prompt) + 3 * 5  # the prompt once, then 5 decodes each
    sched.cache.blocks.check_invariants()


def test_fork_without_room_falls_back_to_an_independent_request():
    cfg = SchedulerConfig(num_blocks=60, num_swa_slots=8, block_size=8, max_num_seqs=1)
    sched = Scheduler(cfg)
    dev = SimDevice(8, VOCAB)
    prompt = list(range(1, 20))
    sched.add_request(Request("p", prompt, 3, frozenset()))
    sched.add_request(Request("c", prompt, 3, frozenset(), fork_of="p"))
    loop = EngineLoop(sched, dev.execute)
    outs = {}
    while loop.has_work():
        for r in loop.step().finished:
            outs[r.request_id] = r.output_token_ids
    assert outs["c"] == outs["p"] == reference(prompt, 3, VOCAB, frozenset())
    assert dev.forked == 0


def test_aborting_fork_children_and_parent_leaves_nothing_behind():
    sched = Scheduler(SchedulerConfig(num_blocks=20, num_swa_slots=4, block_size=4))
    sched.add_request(Request("p", [1, 2, 3, 4, 5], 3, frozenset()))
    sched.add_request(Request("c1", [1, 2, 3, 4, 5], 3, frozenset(), fork_of="p"))
    sched.add_request(Request("c2", [1, 2, 3, 4, 5], 3, frozenset(), fork_of="p"))
    assert sched.abort("c1")
    assert sched.abort("p")  # c2 was never forked: it becomes an ordinary waiting request
    assert [r.request_id for r in sched.waiting] == ["c2"]
    assert sched.abort("c2") and not sched.has_unfinished()


def test_batch_invariant_steps_never_mix_and_cut_prompts_alike_alone_and_in_a_crowd():
    """The batch-invariant mode's scheduling: a step holds decodes or prefill chunks, never
    both, and a prompt's chunks are the same alone and beside 12 other requests (cut at
    multiples of the chunk size), so the model computes each token the same way."""
    cfg = CONFIGS["batch-invariant"]
    target = ("t", [(7 * i) % (VOCAB - 1) + 1 for i in range(70)], 12)

    def chunks(work):
        sched = Scheduler(cfg)
        dev = SimDevice(cfg.block_size, VOCAB)
        for rid, prompt, mx in work:
            sched.add_request(Request(rid, list(prompt), mx, STOP))
        seen: list[tuple[int, int]] = []

        def execute(out):
            kinds = {seq.num_new - seq.num_drafts == 1 for seq in out.seqs}
            assert len(kinds) == 1, f"step {out.step} mixes decodes and prefill chunks"
            seen.extend((q.start_pos, q.num_new) for q in out.seqs if q.request_id == "t" and q.num_new > 1)
            return dev.execute(out)

        loop = EngineLoop(sched, execute)
        done = {}
        for _ in range(10_000):
            if not loop.has_work():
                break
            for r in loop.step().finished:
                done[r.request_id] = list(r.output_token_ids)
        loop.close()
        check_against_reference(work, done)
        return seen

    alone = chunks([target])
    assert alone == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 6)]
    assert chunks(make_workload(5, 12) + [target]) == alone
    with pytest.raises(ValueError, match="invariant_chunk_tokens"):
        dataclasses.replace(cfg, max_num_batched_tokens=12)
