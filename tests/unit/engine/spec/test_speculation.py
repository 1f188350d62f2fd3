"""Speculative decoding in the engine (the trained preset and its MTP layer): the tokens are
those of plain decoding, greedy or seeded, for every policy; prefix hits and JSON-schema
constraints included; and the blocks it publishes hold exactly what plain decoding's hold.

The DSpark runs use a synthetic step profile whose verification cost rises steeply with the
drafts verified, so that the selection verifies some drafts of some requests and not others
(the profile of this machine would pick whatever it measured), taken as it is (no rescaling
by the measured step times, which would move it towards this machine's); identity must hold
for any selection.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.messages import CoreRequest
from engine.model.rope import clear_cos_sin_cache
from engine.prompts import heldout_prompts
from engine.sampling.params import SamplingParams, StructuredOutput
from engine.scheduler.hashing import chain_hashes
from engine.scheduler.output import RunnerOutput
from engine.scheduler.scheduler import Scheduler
from engine.spec.draft_graphs import DraftGraphs
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile
from engine.spec.speculation import NextDrafts

MODEL = Path(__file__).resolve().parents[4] / "models" / "trained"
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
        "required": ["name", "size"],
    }
)


@pytest.fixture(scope="module")
def steep_profile(tmp_path_factory) -> str:
    batch = (1, 8, 32, 128)
    secs = tuple(tuple(0.01 * b**0.5 * (1 + 0.6 * k * k) for k in range(6)) for b in batch)
    path = tmp_path_factory.mktemp("spec") / "steps.json"
    path.write_text(SpecProfile(batch, tuple(range(6)), secs).to_json())
    return str(path)


def _prompts(n: int) -> list[list[int]]:
    """Held-out windows of varied lengths (8 to 300 tokens)."""
    rows = heldout_prompts(MODEL, n, 300)
    return [r[: 8 + (53 * i) % 293] for i, r in enumerate(rows)]


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]


def _workload(n: int) -> list[tuple[list[list[int]], list[SamplingParams]]]:
    """Rounds run in order on one engine: held-out prompts (every 8th under a JSON schema),
    then prompts that extend round 1's first prompts past a full block (prefix hits)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    json_sp = SamplingParams(temperature=0.0, max_tokens=24, structured=StructuredOutput(json_schema=SCHEMA))
    first = _prompts(n)
    params = [json_sp if i % 8 == 3 else greedy for i in range(n)]
    long = [p for p in first if len(p) > 260][:4]
    hits = [p + p[-16:] for p in long]
    return [(first, params), (hits, [greedy] * len(hits))]


def _outputs(
    n: int, stats: dict[str, float] | None = None, max_num_seqs: int = 16, **engine: object
) -> list[list[list[int]]]:
    llm = LLM(MODEL, max_num_seqs=max_num_seqs, num_swa_slots=32, **engine)
    try:
        out = [_generate(llm, prompts, params) for prompts, params in _workload(n)]
        if stats is not None:
            stats.update(llm.core.stats().extra)
        return out
    finally:
        llm.close()


def _check_identity(n: int, steep_profile: str, policies: tuple[str, ...]) -> None:
    """Each policy's tokens equal plain decoding's; a policy named ``"P padded"`` runs P with
    the CUDA graphs' padded batches (verification and drafting chains as the GPU shapes them),
    eagerly."""
    base = _outputs(n)
    for policy in policies:
        name, *padded = policy.split()
        spec = _outputs(
            n,
            speculative=name,
            spec_profile_path=steep_profile,
            spec_measured_costs=False,
            **({"decode_graphs": "padded"} if padded else {}),
        )
        for r, (a, b) in enumerate(zip(base, spec)):
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            assert not bad, f"{policy}, round {r}: prompts {bad[:5]} differ"


def test_greedy_tokens_equal_plain_decoding(steep_profile) -> None:
    """dspark gives plain decoding's tokens (every policy on 100 prompts: slow); so does
    dspark with verification and drafting as the CUDA graphs run them (the rows' tokens
    packed in a token bucket, the drafting chain on the device; eagerly here), whose drafts and
    acceptance are also the unpadded paths'. Four requests at a time, so that prompts are
    computed beside decoding and verifying rows (`ModelRunner.split`)."""
    base = _outputs(12, max_num_seqs=4)
    stats: dict[str, dict[str, float]] = {}
    for name, engine in (("dspark", {}), ("dspark padded", {"decode_graphs": "padded"})):
        stats[name] = {}
        spec = _outputs(
            12,
            stats[name],
            speculative=name.split()[0],
            spec_profile_path=steep_profile,
            spec_measured_costs=False,
            max_num_seqs=4,
            **engine,
        )
        for r, (a, b) in enumerate(zip(base, spec)):
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            assert not bad, f"{name}, round {r}: prompts {bad[:5]} differ"
    eager, padded = stats["dspark"], stats["dspark padded"]
    assert padded["graph_verify_steps"] > 0 and padded["graph_draft_chains"] > 0
    assert (
        padded["split_steps"] > 0 and eager["split_steps"] > 0
    )  # prompts beside decodes: their rows graphed apart
    keys = ("spec_steps", "spec_drafted_tokens", "spec_verified_tokens", "spec_accepted_tokens")
    assert [padded[k] for k in keys] == [eager[k] for k in keys]
    assert padded["spec_accepted_tokens"] > 0


def test_a_kept_drafting_chain_drafts_as_a_fresh_one(steep_profile, monkeypatch) -> None:
    """On the GPU a drafting chain is built once per shape, its static batch run on all-padding
    inputs to warm up, then captured and replayed; here, without graphs, a fresh chain runs
    each time. Kept and warmed up as the GPU keeps them, the padded chains still draft and
    accept what the eager path does: nothing a pass derives from its static batch outlives
    the pass (`ForwardBatch.memo`)."""

    def kept(self: DraftGraphs, b: int, q: int, t: int, depth: int) -> object:
        chains = self.__dict__.setdefault("kept", {})
        if (b, q, t, depth) not in chains:
            chain = chains[(b, q, t, depth)] = self._build(b, q, t, depth)
            chain.inputs.copy_(self._host_inputs(None, b, q, t, depth))
            clear_cos_sin_cache()  # as `DecodeGraphs.capture_graph` does around its warm-up
            self._passes(chain)  # the capture's warm-up
            clear_cos_sin_cache()
        return chains[(b, q, t, depth)]

    stats: dict[str, dict[str, float]] = {"eager": {}, "kept": {}}
    _outputs(
        8, stats["eager"], speculative="dspark", spec_profile_path=steep_profile, spec_measured_costs=False
    )
    monkeypatch.setattr(DraftGraphs, "_chain", kept)
    _outputs(
        8, stats["kept"], speculative="dspark", spec_profile_path=steep_profile, spec_measured_costs=False,
        decode_graphs="padded",
    )  # fmt: skip
    keys = ("spec_steps", "spec_drafted_tokens", "spec_verified_tokens", "spec_accepted_tokens")
    assert stats["kept"]["graph_draft_chains"] > 0
    assert [stats["kept"][k] for k in keys] == [stats["eager"][k] for k in keys]


def test_a_step_s_tokens_reach_the_caller_before_its_drafts_are_read(steep_profile, monkeypatch) -> None:
    """With the drafting chain as the GPU runs it (its padded batches, eagerly here), a step's
    drafts are read only when the next step is scheduled: the scheduler applies the step's
    tokens and the engine hands them to its caller first, which on the GPU is host work done
    while the chain runs. A request that ends in that step gets no drafts, and the tokens are
    plain decoding's."""
    events: list[tuple[str, int]] = []
    seen: list[NextDrafts] = []  # kept alive, so that no two steps' drafts share an id()
    update, read = Scheduler.update, NextDrafts._read

    def applied(self: Scheduler, out: object, result: RunnerOutput) -> object:
        upd = update(self, out, result)
        if isinstance(result.drafts, NextDrafts) and result.drafts._pending is not None:
            seen.append(result.drafts)
            events.append(("applied", id(result.drafts)))
        return upd

    def reading(self: NextDrafts) -> object:
        if self._pending is not None:
            events.append(("read", id(self)))
        return read(self)

    monkeypatch.setattr(Scheduler, "update", applied)
    monkeypatch.setattr(NextDrafts, "_read", reading)
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(MODEL, max_num_seqs=4, num_swa_slots=8)
    try:
        want = _generate(plain, prompts, [params] * len(prompts))
    finally:
        plain.close()
    llm = LLM(
        MODEL, max_num_seqs=4, num_swa_slots=8, speculative="fixed-3", decode_graphs="padded",
    )  # fmt: skip
    try:
        core = llm.core
        for i, p in enumerate(prompts):
            core.add(CoreRequest(f"r{i}", tuple(p), params))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        for _ in range(200):
            if not core.has_work():
                break
            for o in core.step():
                got[o.request_id] += o.new_token_ids
            events.append(("returned", 0))
        assert list(got.values()) == want
    finally:
        llm.close()
    applied_at = {k: i for i, (e, k) in enumerate(events) if e == "applied"}
    read_at = {k: i for i, (e, k) in enumerate(events) if e == "read"}
    returns = [i for i, (e, _) in enumerate(events) if e == "returned"]
    assert len(applied_at) >= 5
    assert set(read_at) <= set(applied_at)
    for k, i in read_at.items():  # applied, handed out, then read
        assert any(applied_at[k] < r < i for r in returns), events
    # the last step's drafts (every request ended in it) are never read
    assert max(applied_at, key=applied_at.get) not in read_at


def test_the_wait_for_a_drafting_chain_counts_in_the_next_step_s_time(monkeypatch) -> None:
    """Read when the next step is scheduled, a drafting chain's drafts take host time that no
    step's execution holds; the loop counts it in the step it schedules, so the step times
    the decode cost model fits (`StepObserver.observe`) still add up to the engine's time.
    Here each read waits 0.3 s, several times a step's own time on this CPU."""
    read = NextDrafts._read

    def slow(self: NextDrafts) -> object:
        if self._pending is not None:
            time.sleep(0.3)
        return read(self)

    monkeypatch.setattr(NextDrafts, "_read", slow)
    llm = LLM(MODEL, max_num_seqs=4, num_swa_slots=8, speculative="fixed-3", decode_graphs="padded")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        _generate(llm, _prompts(2), [params] * 2)
        stats = list(llm.loop.stats)
    finally:
        llm.close()
    after_drafting = stats[1:]  # every step after the prompts' follows a drafting one
    assert len(after_drafting) >= 3
    assert all(s.seconds >= 0.3 for s in after_drafting), [round(s.seconds, 4) for s in stats]


@pytest.mark.slow
def test_greedy_tokens_equal_plain_decoding_on_100_prompts(steep_profile) -> None:
    _check_identity(100, steep_profile, ("fixed-5", "dspark", "dspark-lagged", "fixed-2:5", "dspark padded"))


def test_seeded_sampling_equals_plain_decoding_and_dspark_selects(steep_profile) -> None:
    prompts = _prompts(16)
    # every third penalised: verified on the host, its device penalty row catching up after
    pen = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.95,
            seed=100 + i,
            max_tokens=32,
            ignore_eos=True,
            **(pen if i % 3 == 1 else {}),
        )
        for i in range(len(prompts))
    ]
    plain = LLM(MODEL, max_num_seqs=16)
    try:
        want = _generate(plain, prompts, params)
    finally:
        plain.close()
    llm = LLM(
        MODEL,
        max_num_seqs=16,
        speculative="dspark",
        spec_profile_path=steep_profile,
        spec_measured_costs=False,
    )
    try:
        assert _generate(llm, prompts, params) == want
        stats = llm.core.stats().extra
    finally:
        llm.close()
    # the selection did verify drafts, fewer than it had, and some were accepted
    assert 0 < stats["spec_verified_tokens"] < stats["spec_drafted_tokens"]
    assert stats["spec_accepted_tokens"] > 0
    assert stats.get("spec_policy_dspark", 0) > 0


def _told_times(profile: str, measured: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, dict]:
    """A DSpark engine's run of six prompts, its tokens checked against plain decoding's:
    what the engine told its policy per step (seconds, clean), the wall time of each
    `EngineCore.step` call, and its stats."""
    import time

    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    llm = LLM(
        MODEL, max_num_seqs=16, speculative="dspark", spec_profile_path=profile, spec_measured_costs=measured
    )
    told: list[tuple[float, bool]] = []
    walls: list[float] = []
    try:
        core = llm.core
        observe, step = core.spec.observe_seconds, core.step

        def telling(seconds: float, clean: bool = True) -> None:
            told.append((seconds, clean))
            observe(seconds, clean)

        def timed():
            t0 = time.perf_counter()
            out = step()
            walls.append(time.perf_counter() - t0)
            return out

        monkeypatch.setattr(core.spec, "observe_seconds", telling)
        monkeypatch.setattr(core, "step", timed)
        got = _generate(llm, prompts, params)
        plain = LLM(MODEL, max_num_seqs=16)
        try:  # rescaled or not, the policy only chooses which drafts to verify: the tokens stay
            assert got == _generate(plain, prompts, params)
        finally:
            plain.close()
        return told, walls, core.stats().extra
    finally:
        llm.close()


def test_the_engine_tells_the_policy_each_step_s_wall_time(tmp_path, monkeypatch) -> None:
    """A DSpark engine with measured costs (the default) tells its policy the wall time of
    every step it ran, the whole step (as the profile times steps), and marks the prompts'
    step as not a decode step's; the policy counts the decode steps it priced and rescales the
    (synthetic) profile towards this machine's times; with measured costs off it is told
    nothing."""
    profile = _overlap_profile(tmp_path, verify_s=0.005, fixed_s=0.02, pass_s=0.001)
    told, walls, stats = _told_times(profile, True, monkeypatch)
    assert len(told) == len(walls) > 8
    assert not told[0][1] and all(clean for _, clean in told[1:])  # the prompts' step, then decoding
    assert all(0 < s <= w for (s, _), w in zip(told, walls))
    counted = stats["spec_cost_steps_plain"] + stats["spec_cost_steps_speculating"]
    assert 0 < counted <= len(told) - 1
    assert (stats["spec_cost_scale_plain"], stats["spec_cost_scale_speculating"]) != (1.0, 1.0)
    told, walls, stats = _told_times(profile, False, monkeypatch)
    assert told == [] and walls and "spec_cost_scale_plain" not in stats


class _Routing:
    """Every top-k router decision of the engines run while it is installed, by (the router's
    order of first use in its model, prompt index, position): (its experts, sorted; the margin
    between its k-th and (k+1)-th biased scores). A position computed again (a rejected
    draft's) keeps its last decision, the one of the token that stayed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]) -> None:
        from engine.model import moe
        from engine.runner import ModelRunner

        self._starts = {tuple(p[:16]): i for i, p in enumerate(prompts)}
        self._slot_prompt: dict[int, int | None] = {}
        self._order: dict[int, int] = {}
        self._tokens: tuple[list[int | None], list[int]] = ([], [])
        self.decisions: dict[tuple[int, int, int], tuple[tuple[int, ...], float]] = {}
        execute, route = ModelRunner.execute, moe.Router.forward

        def traced_execute(runner, batch):
            ids, pos = batch.input_ids.tolist(), batch.positions.tolist()
            prompt_of: list[int | None] = []
            for slot, start, n in zip(
                batch.swa_slot.tolist(), batch.query_start.tolist(), batch.query_len.tolist()
            ):
                if n >= 16 and pos[start] == 0:  # a prompt's first chunk: whose slot this is
                    self._slot_prompt[slot] = self._starts.get(tuple(ids[start : start + 16]))
                prompt_of += [self._slot_prompt.get(slot)] * n
            self._tokens = (prompt_of, pos)
            return execute(runner, batch)

        def traced_route(router, x, input_ids):
            prompt_of, pos = self._tokens
            if not router.hashed and x.shape[0] == len(pos):
                order = self._order.setdefault(id(router), len(self._order))
                biased = F.softplus(F.linear(x, router.weight)).sqrt() + router.e_score_correction_bias
                top = biased.float().sort(dim=-1, descending=True)
                k = router.top_k
                margin = (top.values[:, k - 1] - top.values[:, k]).tolist()
                for r, (prompt, p) in enumerate(zip(prompt_of, pos)):
                    if prompt is not None:
                        self.decisions[order, prompt, p] = (
                            tuple(sorted(top.indices[r, :k].tolist())),
                            margin[r],
                        )
            return route(router, x, input_ids)

        monkeypatch.setattr(ModelRunner, "execute", traced_execute)
        monkeypatch.setattr(moe.Router, "forward", traced_route)

    def take(self) -> dict[tuple[int, int, int], tuple[tuple[int, ...], float]]:
        """The decisions so far (one engine's run); the next engine starts afresh."""
        out, self.decisions = self.decisions, {}
        self._slot_prompt.clear()
        self._order.clear()
        return out


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_published_blocks_equal_plain_decodings(steep_profile, monkeypatch) -> None:
    """Every block the speculating engine publishes (prefix cache, hence the store) holds the
    same compressed rows as plain decoding's block of that hash: rejected drafts never reach
    one.

    On the CPU a verification step's matmuls (more rows) round differently from a decode
    step's (~1e-6 apart), so where two experts' router scores tie to within that, the two
    runs can route a token to different experts, and the rows of that sequence from there on
    part by ~1e-2 while its tokens stay equal (found with the shipped weights: an exact tie
    at one position in 2,240). So every routing decision of both runs is recorded; one that
    differs must be such a near tie, and only then are that sequence's blocks from its
    position on left out of the comparison."""
    prompts = [p for p in _prompts(40) if len(p) > 240][:4]  # + 280 tokens: block 1 is decoded
    sp = SamplingParams(temperature=0.0, max_tokens=280, ignore_eos=True)
    routing = _Routing(monkeypatch, prompts)

    def blocks(**engine: object) -> tuple[dict[bytes, list[torch.Tensor]], dict[bytes, tuple[int, range]]]:
        """Rows of every published block by hash, and each hash's (prompt, positions)."""
        llm = LLM(MODEL, max_num_seqs=8, num_blocks=64, **engine)
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
            core = llm.core
            table = core.scheduler.cache.blocks
            rows = {}
            for h in core.cached_hashes():
                block = table.lookup([h], count=False)[0]
                rows[bytes(h)] = [t.clone() for t in core.runner.pool.block_tensors(block)]
            bs = core.scheduler.cache.bs
            where = {
                bytes(h): (i, range(j * bs, (j + 1) * bs))
                for i, (p, o) in enumerate(zip(prompts, outs))
                for j, h in enumerate(chain_hashes([*p, *o.outputs[0].token_ids], bs, core.extra_keys))
            }
            return rows, where
        finally:
            llm.close()

    want, where = blocks()
    plain = routing.take()
    got, _ = blocks(speculative="fixed-5", spec_profile_path=steep_profile)
    spec = routing.take()
    assert got.keys() == want.keys() and len(got) >= 2 * len(prompts) == 8
    assert got.keys() <= where.keys()  # each published block is one of these sequences'

    assert plain and plain.keys() <= spec.keys()  # every decision of plain decoding was seen
    # a sequence's first decision routed differently must be a near tie; every later one
    # (a deeper layer, a later position) follows from it
    parted: dict[int, int] = {}  # prompt -> its first position routed differently
    for order, prompt, pos in sorted(
        (k for k in plain if spec[k][0] != plain[k][0]), key=lambda k: (k[1], k[2], k[0])
    ):
        if prompt not in parted:
            assert min(plain[order, prompt, pos][1], spec[order, prompt, pos][1]) < 1e-5, (order, prompt, pos)
            parted[prompt] = pos
    compared = 0
    for h, tensors in got.items():
        prompt, positions = where[h]
        if prompt in parted and positions.stop > parted[prompt]:
            continue
        compared += 1
        for a, b in zip(tensors, want[h]):
            assert (a - b).abs().max().item() < 1e-4, h.hex()
    assert compared >= 6, (compared, parted)


def _overlap_profile(tmp_path: Path, verify_s: float, fixed_s: float, pass_s: float) -> str:
    """A profile file for batches 1, 8 and 32: plain steps of 0.01 s per request, a step
    verifying k of 5 drafts ``fixed_s + k * verify_s`` per request, drafting passes ``pass_s``."""
    batch = (1, 8, 32)
    secs = tuple(tuple(b * (fixed_s + verify_s * k) for k in range(6)) for b in batch)
    path = tmp_path / "steps.json"
    path.write_text(
        SpecProfile(
            batch, tuple(range(6)), secs, 5, tuple(b * pass_s for b in batch), tuple(b * 0.01 for b in batch)
        ).to_json()
    )
    return str(path)


def _dspark_and_plain(
    profile: str, loop: str, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[LLM, list[list[int]]]:
    """Plain decoding's tokens for ``prompts``, and a DSpark engine on ``profile`` with the
    overlapping step ``loop`` (the caller closes it)."""
    plain = LLM(MODEL, max_num_seqs=16, num_swa_slots=32)
    try:
        want = _generate(plain, prompts, params)
    finally:
        plain.close()
    llm = LLM(
        MODEL,
        max_num_seqs=16,
        num_swa_slots=32,
        speculative="dspark",
        spec_profile_path=profile,
        spec_measured_costs=False,
        **{loop: True},
    )
    return llm, want


# pipelined steps are the CUDA default; asynchronous scheduling (opt-in) is the slow suite's
OVERLAPPED_LOOPS = [pytest.param("async_scheduling", marks=pytest.mark.slow), "pipeline_steps"]


@pytest.mark.parametrize("loop", OVERLAPPED_LOOPS)
def test_speculation_switched_off_overlaps_steps_and_keeps_the_tokens(tmp_path, loop: str) -> None:
    """A profile on which speculation never pays (verification at ~10 plain steps, as the
    H200's eager verification once measured): DSpark drafts nothing, not even in the prompts'
    step, and decodes plainly from the first step; the engine then schedules (asynchronous
    steps) or launches (pipelined steps) step N+1 while step N runs, as plain decoding does;
    the tokens are plain decoding's."""
    profile = _overlap_profile(tmp_path, verify_s=0.05, fixed_s=0.04, pass_s=0.006)
    prompts = _prompts(6)
    greedy = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    llm, want = _dspark_and_plain(profile, loop, prompts, greedy)
    try:
        assert _generate(llm, prompts, greedy) == want
        assert (llm.loop.overlapped if loop == "async_scheduling" else llm.loop.pipelined) > 0
        spec = llm.core.spec
        assert (spec.stats.drafted, spec.stats.verified, spec.mode, spec.depth) == (0, 0, "off", 0)
        assert set(spec.stats.policies) <= {"off"}, spec.stats.policies
    finally:
        llm.close()


@pytest.mark.parametrize("loop", OVERLAPPED_LOOPS)
def test_speculation_off_on_evidence_keeps_probing_in_overlapped_steps(
    tmp_path, monkeypatch, loop: str
) -> None:
    """Off on evidence (the trained preset's drafts are accepted too rarely for this profile's
    verification price, though with every draft accepted K = 5 would pay: 6 / 4.5 plain
    steps), DSpark keeps probing in steps launched or scheduled while the one before runs:
    their inputs are still on the device, nothing is verified, and the policy counts each
    ``off`` and drafts again every `probe_every` steps. Such steps once never reached the
    policy, which then never drafted again. The tokens stay plain decoding's."""
    profile = _overlap_profile(tmp_path, verify_s=0.005, fixed_s=0.02, pass_s=0.001)
    monkeypatch.setattr(SpecPolicy, "PROBE_BUDGET", 1.0)  # a probe every 8 steps, not every ~800
    prompts = [p[:200] for p in _prompts(8)[4:]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)] * len(prompts)
    llm, want = _dspark_and_plain(profile, loop, prompts, greedy)
    try:
        spec = llm.core.spec
        seen: list[tuple[str, str, int]] = []  # per planned step: policy, mode after it, next depth
        choose = spec.choose

        def recording(*args, **kwargs):
            out = choose(*args, **kwargs)
            seen.append((out[1], spec.mode, spec.depth))
            return out

        idle = spec.idle

        def recording_idle(*args, **kwargs):  # a step in which no request has drafts
            before = spec.stats.policies["off"]
            idle(*args, **kwargs)
            seen.append(("off" if spec.stats.policies["off"] > before else "none", spec.mode, spec.depth))

        monkeypatch.setattr(spec, "choose", recording)
        monkeypatch.setattr(spec, "idle", recording_idle)
        assert _generate(llm, prompts, greedy) == want
        assert spec.probe_every(len(prompts)) == 8
        assert (llm.loop.overlapped if loop == "async_scheduling" else llm.loop.pipelined) > 0
        off = next(i for i, (_, mode, _) in enumerate(seen) if mode == "off")
        probes = [i for i, (_, mode, depth) in enumerate(seen) if i > off and mode == "off" and depth == 5]
        assert len(probes) >= 5, seen
        assert sum(name == "off" for name, _, _ in seen) >= 40, seen
    finally:
        llm.close()


def test_a_named_step_profile_that_is_not_there_is_refused(tmp_path) -> None:
    """A profile named in the settings (a cluster spec's ``decode.spec_profile``) must exist:
    an engine that silently scheduled without it would run another policy than configured."""
    from engine.core import EngineConfig, EngineCore

    missing = tmp_path / "rank.json"
    with pytest.raises(ValueError, match="spec_profile_path .*rank.json' is not a file"):
        EngineCore(EngineConfig(model=str(MODEL), speculative="dspark", spec_profile_path=str(missing)))
