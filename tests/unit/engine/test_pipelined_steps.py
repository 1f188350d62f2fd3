"""Pipelined steps (engine/loop.py, `ModelExecutor.launch` / `finish`): step N+1 is launched,
its greedy input tokens read from step N's device argmax, before step N is sampled on the
host. Every request's tokens (and logprobs) must be those of plain synchronous steps, for a
mix of greedy, stopped, sampled, penalised, forked and logprob requests that end at
different steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.prompts import heldout_prompts
from engine.sampling.params import SamplingParams

MODEL = Path(__file__).resolve().parents[3] / "models" / "trained"


def _prompts(n: int) -> list[list[int]]:
    rows = heldout_prompts(MODEL, n, 200)
    return [r[: 6 + (41 * i) % 190] for i, r in enumerate(rows)]


def _run(prompts, params, pipeline: bool, max_num_seqs: int = 16, **kw) -> tuple[list, LLM]:
    llm = LLM(MODEL, max_num_seqs=max_num_seqs, num_swa_slots=32, pipeline_steps=pipeline, **kw)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        got = [
            [(list(c.token_ids), [None if lp is None else round(lp.logprob, 4) for lp in (c.logprobs or [])])
             for c in o.outputs]
            for o in outs
        ]  # fmt: skip
        return got, llm
    except BaseException:
        llm.close()
        raise


def _mixed(prompts: list[list[int]], stops: list[int]) -> list[SamplingParams]:
    kinds = [
        lambda i: SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stops[i],)),
        lambda i: SamplingParams(temperature=0.8, max_tokens=12 + i, seed=100 + i, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.7, n=2, max_tokens=9, seed=7 + i, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.0, max_tokens=11, repetition_penalty=1.3, ignore_eos=True),
    ]
    return [kinds[i % len(kinds)](i) for i in range(len(prompts))]


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="the trained preset is not built")
def test_pipelined_steps_give_the_synchronous_tokens() -> None:
    prompts = _prompts(12)
    # stop tokens each greedy request meets mid-generation: requests end at different steps
    probe, llm = _run(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 12, False)
    llm.close()
    stops = [p[0][0][3 + i % 7] for i, p in enumerate(probe)]
    params = _mixed(prompts, stops)
    want, sync = _run(prompts, params, False)
    sync.close()
    got, piped = _run(prompts, params, True)
    try:
        assert got == want
        stopped = [w[0][0] for w, sp in zip(want, params) if sp.stop_token_ids]
        assert any(len(t) < 40 for t in stopped)  # some request did stop early
        assert piped.loop.overlapped > 0
        assert piped.core.executor.fed_tokens > 0  # step N+1 launched before N was sampled
        assert sync.core.executor.fed_tokens == 0
    finally:
        piped.close()


#: plain greedy, and draws with truncation (each row its own top-k / top-p / min-p)
KINDS = {
    "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    "sampled": lambda i: SamplingParams(
        temperature=0.9, top_k=(0, 20)[i % 2], top_p=(1.0, 0.9)[i // 2 % 2], min_p=(0.0, 0.05)[i // 4 % 2],
        seed=11 + i, max_tokens=16, ignore_eos=True,
    ),
}  # fmt: skip


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="the trained preset is not built")
# each path and each kind once in `make test`; the other two pairings in `make test-slow`
@pytest.mark.parametrize(
    ("graphs", "kind"),
    [
        ("off", "greedy"),
        ("padded", "sampled"),
        pytest.param("off", "sampled", marks=pytest.mark.slow),
        pytest.param("padded", "greedy", marks=pytest.mark.slow),
    ],
)
def test_a_decoding_batch_reads_every_input_token_on_the_device(graphs: str, kind: str) -> None:
    """Greedy or drawn together: every step after the first launches before its predecessor
    is sampled, so each decode input token is fed on the device; also through the CUDA
    graphs' padded batches (run eagerly here), whose static inputs take the fed ids."""
    prompts = _prompts(6)
    params = [KINDS[kind](i) for i in range(6)]
    want, sync = _run(prompts, params, False)
    sync.close()
    got, piped = _run(prompts, params, True, decode_graphs=graphs)
    try:
        assert got == want
        # 15 decode inputs per request; the first decode step may follow the prefill chunks
        assert piped.core.executor.fed_tokens >= 6 * 14
    finally:
        piped.close()


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="the trained preset is not built")
@pytest.mark.parametrize("graphs", ["off", "padded"])
def test_prompts_beside_pipelined_decodes_keep_the_synchronous_tokens(graphs: str) -> None:
    """Three slots for eight requests: each later prompt is computed beside decode rows whose
    input tokens come from the step still in flight, and the step runs in two passes
    (`ModelRunner.split`: the fed tokens follow their rows into the decode pass)."""
    prompts = _prompts(8)
    lengths = [6 + 5 * i for i in range(8)]  # requests finish, and slots refill, at different steps
    params = [
        dataclasses.replace(KINDS["greedy" if i % 2 else "sampled"](i), max_tokens=n)
        for i, n in enumerate(lengths)
    ]
    want, sync = _run(prompts, params, False, max_num_seqs=3)
    sync.close()
    got, piped = _run(prompts, params, True, max_num_seqs=3, decode_graphs=graphs)
    try:
        assert got == want
        assert piped.core.runner.split_steps > 0 and piped.core.executor.fed_tokens > 0
    finally:
        piped.close()


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="the trained preset is not built")
def test_an_id_reused_after_abort_gets_none_of_the_old_steps_tokens() -> None:
    """Aborted while its next step is launched, then added again under the same id at once:
    the steps in flight are applied first (`EngineCore._settle`), so the new request's tokens
    are a fresh run's, not the old request's continuation (before, the old step sampled with
    the new request's state and failed the batch)."""
    from engine.messages import CoreRequest
    from tests.engine_steps import step_until

    prompt = _prompts(1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(MODEL, max_num_seqs=4, num_swa_slots=8, pipeline_steps=True)
    try:
        core = llm.core

        core.add(CoreRequest("fresh", tuple(prompt), params))
        want = step_until(core, "fresh")[0]
        core.add(CoreRequest("x", tuple(prompt), params))
        got: list[int] = []
        while len(got) < 2:
            got += [t for o in core.step() if o.request_id == "x" for t in o.new_token_ids]
        assert core.loop.in_flight("x")  # a step of the old request is launched
        assert core.abort("x")
        core.take_outputs()
        core.add(CoreRequest("x", tuple(prompt), params))
        assert step_until(core, "x")[0] == want
    finally:
        llm.close()
