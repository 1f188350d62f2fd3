"""Control tokens never reach a client's text unless it asks (``skip_special_tokens: false``).

The tiny checkpoint's random weights emit control tokens (``<｜User｜>``, FIM and grounding
markup, ``<｜image｜>``...) in almost every answer, which makes it the right model for this:
the same seeded requests show them with the opt-out and never without it, through the
`openai` and `anthropic` SDKs, streamed or not; usage still counts every generated token.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from engine.structured.tokenizer import control_tokens

pytestmark = pytest.mark.integration
USER = [{"role": "user", "content": "Hello there"}]
SEEDS = range(6)


@pytest.fixture(scope="module")
def oai(api_server):
    return openai.OpenAI(base_url=api_server.v1, api_key=api_server.api_key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def controls(api_server) -> list[str]:
    """The spellings of every control token of the served tokenizer (none is parsed in a
    non-thinking chat without tools, or in a legacy completion)."""
    return list(control_tokens(api_server.engine.model_info().tokenizer_path))


def leaked(text: str | None, controls: list[str]) -> list[str]:
    return [c for c in controls if c in (text or "")]


def chat(oai, seed: int, **extra):
    return oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=48, seed=seed, temperature=1.0, **extra
    )


def test_only_what_the_parser_reads_for_the_request_stays(api_server):
    import deepseek_recipe as dr

    from services.api.convert import Converter

    conv = Converter(api_server.config, api_server.engine.model_info())
    ids = control_tokens(api_server.engine.model_info().tokenizer_path)
    plain = dr.ParsingOptions(parse_tool_calls=False, thinking_initial_stage=None, stop_sequences=[])
    tools = dr.ParsingOptions(parse_tool_calls=True, thinking_initial_stage=None, stop_sequences=[])
    hidden, with_tools = conv.hidden_ids({}, plain), conv.hidden_ids({}, tools)
    assert hidden == frozenset(ids.values())  # nothing is parsed: everything is hidden
    assert ids["｜DSML｜"] not in with_tools and ids["<think>"] in with_tools
    for gone in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜image｜>", "<｜fim▁hole｜>", "<｜box｜>"):
        assert ids[gone] in with_tools
    assert conv.hidden_ids({"skip_special_tokens": False}, plain) == frozenset()


def test_chat_content_has_no_control_tokens_unless_asked(oai, controls):
    shown = 0
    for seed in SEEDS:
        plain = chat(oai, seed)
        msg = plain.choices[0].message
        assert leaked(msg.content, controls) == []
        assert leaked((msg.model_extra or {}).get("reasoning_content"), controls) == []
        raw = chat(oai, seed, extra_body={"skip_special_tokens": False})
        shown += bool(leaked(raw.choices[0].message.content, controls))
        # the same tokens were generated and billed either way
        assert plain.usage.completion_tokens == raw.usage.completion_tokens
    assert shown >= 3  # the opt-out really shows them: this test can fail


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_streamed_chat_and_legacy_completions_hide_them_too(oai, controls):
    for seed in SEEDS:
        stream = oai.chat.completions.create(
            model="deepseek-chat", messages=USER, max_tokens=48, seed=seed, temperature=1.0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert leaked(text, controls) == []
        done = oai.completions.create(model="deepseek-chat", prompt="def f(", max_tokens=48, seed=seed)
        assert leaked(done.choices[0].text, controls) == []


def test_anthropic_messages_hide_them(api_server, controls):
    claude = anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, timeout=120, max_retries=0
    )
    for seed in SEEDS:
        r = claude.messages.create(
            model="deepseek-chat", max_tokens=48, messages=USER, extra_body={"seed": seed, "temperature": 1.0}
        )
        text = "".join(getattr(b, "text", "") or "" for b in r.content)
        assert leaked(text, controls) == []


def test_a_non_boolean_opt_out_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, 0, extra_body={"skip_special_tokens": "no"})
    assert "skip_special_tokens must be a boolean" in str(err.value)
