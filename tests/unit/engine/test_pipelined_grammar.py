"""Pipelined steps with grammars and penalties (`ModelExecutor._complete`): their rows are
sampled on the device once the previous step finishes, so their next input token is fed on
the device like a greedy one's. Tokens must be those of plain synchronous steps, outputs must
still satisfy their grammar, and a grammar that fails mid-run fails only its request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutput
from services.bench._structured_cases import SCHEMAS
from tests.unit.engine.refmodel import build_reference

FULL_VOCAB = 129_280
N = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-fullvocab-pipelined")
    build_reference(path, "mixed_hc2", vocab_size=FULL_VOCAB)
    return path


def _params(i: int) -> SamplingParams:
    schema = StructuredOutput(json_schema=json.dumps(SCHEMAS[i]))
    if i % 3 == 0:  # greedy under a grammar
        return SamplingParams(temperature=0.0, max_tokens=48, structured=schema)
    if i % 3 == 1:  # drawn under a grammar, with penalties
        return SamplingParams(
            temperature=0.8,
            seed=5 + i,
            max_tokens=48,
            structured=schema,
            presence_penalty=0.4,
            frequency_penalty=0.2,
        )
    # penalties alone, greedy and drawn; the drawn one forks (n = 2: each child its own history)
    return SamplingParams(
        temperature=(0.0, 0.7)[i % 2], seed=9 + i, max_tokens=24, repetition_penalty=1.2, ignore_eos=True,
        n=1 + i % 2,
    )  # fmt: skip


def _run(model, pipeline: bool, params: list[SamplingParams]) -> tuple[list, int, int]:
    llm = LLM(model, num_blocks=40, num_swa_slots=16, max_num_seqs=8, pipeline_steps=pipeline)
    try:
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(len(params))]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        got = [(list(c.token_ids), c.finish_reason, c.text) for o in outs for c in o.outputs]
        return got, llm.core.executor.fed_tokens, llm.loop.overlapped
    finally:
        llm.close()


def test_grammar_and_penalty_rows_are_fed_on_the_device_and_give_the_synchronous_tokens(model) -> None:
    params = [_params(i) for i in range(N)]
    want, fed_sync, _ = _run(model, False, params)
    got, fed, overlapped = _run(model, True, params)
    assert got == want
    assert fed_sync == 0 and overlapped > 0
    decoded = sum(len(t) - 1 for t, _, _ in got)  # every decode input token after the first
    assert fed >= decoded - 2 * N  # (the first decode step of each request may follow its prefill)
    validated = 0
    owner = [i for i, p in enumerate(params) for _ in range(p.n)]  # the request of each output
    assert len(owner) == len(got) > N
    for i, (_, reason, text) in zip(owner, got):
        if params[i].structured is not None and reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[i])
            validated += 1
    assert validated >= 2, got


def test_a_grammar_failing_mid_run_fails_only_its_request_when_pipelined(model) -> None:
    llm = LLM(
        model,
        num_blocks=16,
        num_swa_slots=8,
        max_num_seqs=8,
        pipeline_steps=True,
        grammar_compile_timeout_s=60.0,
    )
    try:
        bad = SamplingParams(
            temperature=0.0, max_tokens=160, structured=StructuredOutput(regex="((a{100}){100}){100}")
        )
        good = SamplingParams(temperature=0.0, max_tokens=6)
        outs = llm.generate(["bad grammar", "plain"], [bad, good])
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
        assert llm.generate(["still serving"], good)[0].outputs[0].finish_reason == "length"
    finally:
        llm.close()
