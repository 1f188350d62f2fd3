"""Structured output and stop strings through ``LLM.generate`` on a tiny checkpoint with the
real DeepSeek-V4 vocabulary (129,280 tokens), so grammars and text see the real tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutput
from engine.structured.grammar import GrammarError
from services.bench._structured_cases import SCHEMAS
from tests.unit.engine.refmodel import build_reference

FULL_VOCAB = 129_280


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-fullvocab")
    build_reference(path, "mixed_hc2", vocab_size=FULL_VOCAB)
    engine = LLM(path, num_blocks=40, num_swa_slots=40, max_num_seqs=32, max_num_batched_tokens=512)
    yield engine
    engine.close()


def constrained(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=160, structured=StructuredOutput(**kw))


@pytest.mark.slow  # ~30 s on 2 busy cores; the same 30 schemas run in the fast suite on random logits
def test_thirty_json_schemas_parse_and_validate(llm):
    params = [constrained(json_schema=json.dumps(s)) for s in SCHEMAS]
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(len(SCHEMAS))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(
            json.loads(c.text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )


def test_regex_and_ebnf_and_rejection_keeps_serving(llm):
    cases = [
        (constrained(regex=r"[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (
            constrained(grammar='start: "f(" num ("," num){0,2} ")"\nnum: /[0-9]{1,3}/'),
            r"f\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)",
        ),
    ]
    outs = llm.generate(prompt_token_ids=[[5, 6, 7]] * len(cases), sampling_params=[c for c, _ in cases])
    for (_, pattern), out in zip(cases, outs):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    with pytest.raises(GrammarError, match="json_schema is invalid"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=constrained(json_schema='{"type": 5}'))
    assert not llm.scheduler.has_unfinished()  # nothing half-admitted
    again = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=cases[0][0])
    assert again[0].outputs[0].text == outs[0].outputs[0].text


def test_stop_strings_are_cut_and_never_leak(llm):
    free = llm.generate(
        prompt_token_ids=[[11, 12, 13]],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    text = free[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]  # a stop string that occurs in the greedy text
    cut = llm.generate(
        prompt_token_ids=[[11, 12, 13]],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,)),
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]


def test_chat_messages_are_rendered_by_deepseek_recipe(llm):
    msgs = [{"role": "user", "content": "Hello"}]
    ids = llm.render_chat(msgs)
    assert ids and all(0 <= t < FULL_VOCAB for t in ids)
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].prompt_token_ids == ids and len(out[0].outputs[0].token_ids) == 4


def test_a_grammar_failing_mid_run_fails_only_its_request(tmp_path):
    """llguidance accepts ((a{100}){100}){100} at compile time but its lexer gives up on the
    first token: that request ends with finish_reason "error"; its batch-mate and later
    requests are served (before the fix the exception killed the engine loop)."""
    path = tmp_path / "v4"
    build_reference(path, "mixed_hc2", vocab_size=FULL_VOCAB)
    # a generous compile limit, so the failure happens mid-run whatever the machine's load
    engine = LLM(path, num_blocks=16, num_swa_slots=8, max_num_seqs=8, grammar_compile_timeout_s=60.0)
    try:
        bad = constrained(regex="((a{100}){100}){100}")
        good = SamplingParams(temperature=0.0, max_tokens=6)
        outs = engine.generate(["bad grammar", "plain"], [bad, good])
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
        again = engine.generate(["still serving"], good)[0].outputs[0]
        assert again.finish_reason == "length"
    finally:
        engine.close()
