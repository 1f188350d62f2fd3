"""Constrained decoding over the real DeepSeek-V4 vocabulary, driven by seeded random logits.

Random logits exercise the constraint machinery independently of any model: whatever the
"model" prefers, every completion must parse and validate. A mild bias towards tokens
that close strings/objects keeps completions short.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.sampling.params import SamplingParams, StructuredOutput
from engine.sampling.sampler import RowInput, sample_row
from engine.structured.grammar import GrammarCompiler, GrammarConfig, GrammarError
from engine.structured.matcher import GrammarState
from engine.structured.tokenizer import deepseek_tokenizer_json, eos_token_id, ll_tokenizer
from services.bench._structured_cases import SCHEMAS

MAX_STEPS = 400


@pytest.fixture(scope="module")
def env():
    from tokenizers import Tokenizer

    path = deepseek_tokenizer_json()
    hf = Tokenizer.from_file(str(path))
    vocab = hf.get_vocab_size()
    texts = hf.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    bias = torch.tensor([2.5 if any(c in t for c in '"}],') else 0.0 for t in texts])  # [V]
    tok = ll_tokenizer(str(path))
    compiler = GrammarCompiler(tok)
    yield {
        "hf": hf,
        "vocab": vocab,
        "bias": bias,
        "tok": tok,
        "compiler": compiler,
        "eos": eos_token_id(path),
    }
    compiler.close()


def generate(env, spec: StructuredOutput, seed: int) -> str:
    state = GrammarState(env["compiler"].compile(spec), env["tok"], env["vocab"])
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0)
    out: list[int] = []
    for step in range(MAX_STEPS):
        logits = torch.randn(env["vocab"], generator=gen) * 2.0 + env["bias"]  # [V]
        token = sample_row(logits, RowInput(params, seed, step, [], out, state.allowed_mask())).token_id
        if token == env["eos"]:
            assert state.is_accepting
            break
        state.accept(token)
        out.append(token)
        if state.is_finished:
            break
    else:
        pytest.fail(f"no completion within {MAX_STEPS} tokens: {env['hf'].decode(out)!r}")
    return env["hf"].decode(out)


@pytest.mark.parametrize("idx", range(len(SCHEMAS)))
def test_json_schema_outputs_parse_and_validate(env, idx):
    schema = SCHEMAS[idx]
    text = generate(env, StructuredOutput(json_schema=json.dumps(schema)), seed=idx)
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


REGEXES = [
    r"[0-9]{3}-[0-9]{2}",
    r"(cat|dog|bird)s?",
    r"[A-Z][a-z]{1,6} [A-Z][a-z]{1,6}",
    r"0x[0-9a-f]{1,8}",
    r"(true|false)(,(true|false)){0,3}",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fully_match(env, pattern):
    for seed in range(2):
        text = generate(env, StructuredOutput(regex=pattern), seed)
        assert re.fullmatch(pattern, text), text


EBNF = {
    "sum": ('start: num ("+" num){0,4}\nnum: /[1-9][0-9]{0,2}/', r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,4}"),
    "call": (
        'start: name "(" args? ")"\nargs: arg ("," arg){0,2}\narg: /[a-z]{1,4}/ | /[0-9]{1,3}/\nname: "f" | "g"',
        r"[fg]\((([a-z]{1,4}|[0-9]{1,3})(,([a-z]{1,4}|[0-9]{1,3})){0,2})?\)",
    ),
    "list": (
        'start: "[" (item (", " item){0,3})? "]"\nitem: "a" | "bb" | "ccc"',
        r"\[((a|bb|ccc)(, (a|bb|ccc)){0,3})?\]",
    ),
}


@pytest.mark.parametrize("name", sorted(EBNF))
def test_ebnf_outputs_are_in_the_language(env, name):
    grammar, equivalent_regex = EBNF[name]
    for seed in range(2):
        text = generate(env, StructuredOutput(grammar=grammar), seed)
        assert re.fullmatch(equivalent_regex, text), text


PATHOLOGICAL = [
    (StructuredOutput(json_schema="{not json"), "not valid JSON"),
    (StructuredOutput(json_schema='{"type": "strnig"}'), "invalid at type"),
    (StructuredOutput(json_schema='{"type": "object", "required": "x"}'), "invalid at required"),
    (StructuredOutput(json_schema='{"$ref": "#/$defs/missing"}'), "json_schema rejected"),
    (StructuredOutput(json_schema="[" * 5000 + "]" * 5000), "nests too deeply|not valid JSON"),
    (StructuredOutput(regex="(unclosed"), "regex rejected"),
    (StructuredOutput(regex="a" * 70_000), "bytes; the limit"),
    (StructuredOutput(grammar="start: undefined_rule"), "grammar rejected"),
    (StructuredOutput(grammar=""), "Empty grammar"),
    (StructuredOutput(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'), "Unsatisfiable"),
]


def test_pathological_grammars_are_rejected_and_compiler_keeps_serving(env):
    compiler = GrammarCompiler(env["tok"], GrammarConfig(max_source_bytes=64 * 1024))
    try:
        for spec, match in PATHOLOGICAL:
            with pytest.raises(GrammarError, match=match):
                compiler.compile(spec)
        # Still serving: a good grammar compiles and constrains after all the failures.
        assert generate(env, StructuredOutput(regex="(ok|fine)"), 0) in ("ok", "fine")
    finally:
        compiler.close()


def test_compile_cache_hits_on_canonically_equal_schemas(env):
    compiler = GrammarCompiler(env["tok"])
    try:
        a = compiler.compile(StructuredOutput(json_schema='{"type": "integer", "minimum": 1}'))
        b = compiler.compile(StructuredOutput(json_schema='{"minimum": 1,  "type": "integer"}'))
        assert a is b and compiler.hits == 1 and compiler.misses == 1
    finally:
        compiler.close()


def test_compile_time_limit(env):
    # A regex whose lexer automaton takes ~0.5 s to build on this machine.
    compiler = GrammarCompiler(env["tok"], GrammarConfig(compile_timeout_s=0.05))
    try:
        with pytest.raises(GrammarError, match="longer than 0.05s"):
            compiler.compile(StructuredOutput(regex="x{1000000}"))
    finally:
        compiler.close()
