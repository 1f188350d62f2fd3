"""Speculative decoding in the engine (the trained preset and its MTP layer): the tokens are
those of plain decoding, greedy or seeded, for every policy; prefix hits and JSON-schema
constraints included; and the blocks it publishes hold exactly what plain decoding's hold.

The DSpark runs use a synthetic step profile whose verification cost rises steeply with the
drafts verified, so that the selection verifies some drafts of some requests and not others
(the profile of this machine would pick whatever it measured); identity must hold for any
selection.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.prompts import heldout_prompts
from engine.sampling.params import SamplingParams, StructuredOutput
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile

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


def _outputs(n: int, stats: dict[str, float] | None = None, **engine: object) -> list[list[list[int]]]:
    llm = LLM(MODEL, max_num_seqs=16, num_swa_slots=32, **engine)
    try:
        out = [_generate(llm, prompts, params) for prompts, params in _workload(n)]
        if stats is not None:
            stats.update(llm.core.stats().extra)
        return out
    finally:
        llm.close()


def _check_identity(n: int, steep_profile: str, policies: tuple[str, ...]) -> None:
    base = _outputs(n)
    for policy in policies:
        spec = _outputs(n, speculative=policy, spec_profile_path=steep_profile)
        for r, (a, b) in enumerate(zip(base, spec)):
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            assert not bad, f"{policy}, round {r}: prompts {bad[:5]} differ"


def test_greedy_tokens_equal_plain_decoding(steep_profile) -> None:
    """dspark and fixed-2:5 give plain decoding's tokens (100 prompts x 4 policies: slow); so
    does dspark with verification and drafting as the CUDA graphs run them (rows padded to the
    step's most tokens, the drafting chain on the device; eagerly here), whose drafts and
    acceptance are also the unpadded paths'."""
    base = _outputs(12)
    stats: dict[str, dict[str, float]] = {}
    for name, engine in (("dspark", {}), ("dspark padded", {"decode_graphs": "padded"}), ("fixed-2:5", {})):
        stats[name] = {}
        spec = _outputs(
            12, stats[name], speculative=name.split()[0], spec_profile_path=steep_profile, **engine
        )
        for r, (a, b) in enumerate(zip(base, spec)):
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            assert not bad, f"{name}, round {r}: prompts {bad[:5]} differ"
    eager, padded = stats["dspark"], stats["dspark padded"]
    assert padded["graph_verify_steps"] > 0 and padded["graph_draft_chains"] > 0
    keys = ("spec_steps", "spec_drafted_tokens", "spec_verified_tokens", "spec_accepted_tokens")
    assert [padded[k] for k in keys] == [eager[k] for k in keys]
    assert padded["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_greedy_tokens_equal_plain_decoding_on_100_prompts(steep_profile) -> None:
    _check_identity(100, steep_profile, ("fixed-5", "dspark", "dspark-lagged", "fixed-2:5"))


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
    llm = LLM(MODEL, max_num_seqs=16, speculative="dspark", spec_profile_path=steep_profile)
    try:
        assert _generate(llm, prompts, params) == want
        stats = llm.core.stats().extra
    finally:
        llm.close()
    # the selection did verify drafts, fewer than it had, and some were accepted
    assert 0 < stats["spec_verified_tokens"] < stats["spec_drafted_tokens"]
    assert stats["spec_accepted_tokens"] > 0
    assert stats.get("spec_policy_dspark", 0) > 0


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_published_blocks_equal_plain_decodings(steep_profile) -> None:
    """Every block the speculating engine publishes (prefix cache, hence the store) holds the
    same compressed rows as plain decoding's block of that hash: rejected drafts never reach
    one."""
    prompts = [p for p in _prompts(40) if len(p) > 240][:4]  # + 280 tokens: block 1 is decoded
    sp = SamplingParams(temperature=0.0, max_tokens=280, ignore_eos=True)

    def blocks(**engine: object) -> dict[bytes, list[torch.Tensor]]:
        llm = LLM(MODEL, max_num_seqs=8, num_blocks=64, **engine)
        try:
            llm.generate(prompt_token_ids=prompts, sampling_params=sp)
            core = llm.core
            table = core.scheduler.cache.blocks
            out = {}
            for h in core.cached_hashes():
                block = table.lookup([h], count=False)[0]
                out[bytes(h)] = [t.clone() for t in core.runner.pool.block_tensors(block)]
            return out
        finally:
            llm.close()

    want = blocks()
    got = blocks(speculative="fixed-5", spec_profile_path=steep_profile)
    assert got.keys() == want.keys() and len(got) >= 2 * len(prompts) == 8
    for h, tensors in got.items():
        for a, b in zip(tensors, want[h]):
            assert (a - b).abs().max().item() < 1e-4, h.hex()


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
        **{loop: True},
    )
    return llm, want


@pytest.mark.parametrize("loop", ["async_scheduling", "pipeline_steps"])
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


@pytest.mark.parametrize("loop", ["async_scheduling", "pipeline_steps"])
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
    monkeypatch.setattr(SpecPolicy, "PROBE_BUDGET", 0.5)  # a probe every 9 steps, not every 450
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

        monkeypatch.setattr(spec, "choose", recording)
        assert _generate(llm, prompts, greedy) == want
        assert spec.probe_every(len(prompts)) == 9
        assert (llm.loop.overlapped if loop == "async_scheduling" else llm.loop.pipelined) > 0
        off = next(i for i, (_, mode, _) in enumerate(seen) if mode == "off")
        probes = [i for i, (_, mode, depth) in enumerate(seen) if i > off and mode == "off" and depth == 5]
        assert len(probes) >= 5, seen
        assert sum(name == "off" for name, _, _ in seen) >= 40, seen
    finally:
        llm.close()
