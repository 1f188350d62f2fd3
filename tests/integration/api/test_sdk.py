"""The server driven by the official ``openai`` and ``anthropic`` SDKs, on the real engine.

The tiny checkpoint's weights are random, so the tests assert protocol behaviour that holds
for any weights: deterministic sampling (same seed, same tokens, streamed or not),
constrained outputs that parse and validate, stop sequences that cut exactly where the
unconstrained text had them, and usage equal to what the engine and recipe count.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Say something in json about the weather."}]


@pytest.fixture(scope="module")
def oai(api_server):
    return openai.OpenAI(base_url=api_server.v1, api_key=api_server.api_key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def claude(api_server):
    return anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, timeout=120, max_retries=0
    )


def expected_prompt_tokens(api_server, body: dict) -> int:
    """The official count: recipe's conversion and V4.1 encoding, as a client could compute it."""
    import deepseek_recipe as dr

    opts = dr.ConversionOptions().with_model_alias(body["model"], dr.ModelVersion.DeepseekV41Flash)
    if body["model"] == "deepseek-chat":
        opts = opts.with_default_thinking_mode(False)
    conv = dr.ChatCompletionRequest(body).convert(opts)
    tok = dr.Tokenizer.from_file(api_server.engine.model_info().tokenizer_path)
    return len(dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv.conversation))


def test_models_lists_the_served_id_and_aliases(oai, api_server):
    ids = {m.id for m in oai.models.list().data}
    assert api_server.config.served_model_name in ids and {"deepseek-chat", "deepseek-reasoner"} <= ids


def test_chat_non_streaming_usage_matches_engine_and_recipe(oai, api_server):
    before = api_server.engine.stats().requests_total
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=12, seed=7, temperature=0.8
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens == expected_prompt_tokens(api_server, {"model": "deepseek-chat", "messages": USER})
    assert u.completion_tokens == 12 if choice.finish_reason == "length" else u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra or {}
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == u.prompt_tokens
    assert api_server.engine.stats().requests_total == before + 1


def test_streaming_and_non_streaming_give_the_same_tokens(oai):
    kwargs = dict(model="deepseek-chat", messages=USER, max_tokens=16, seed=123, temperature=1.0)
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [full.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_reasoning_model_streams_reasoning_content(oai):
    r = oai.chat.completions.create(model="deepseek-reasoner", messages=USER, max_tokens=10, seed=1)
    msg = r.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning  # thinking mode: the random model never closes </think>, so it is all reasoning
    details = (r.usage.model_extra or {}).get(
        "completion_tokens_details"
    ) or r.usage.completion_tokens_details
    reasoning_tokens = details["reasoning_tokens"] if isinstance(details, dict) else details.reasoning_tokens
    assert 0 < reasoning_tokens <= r.usage.completion_tokens


def test_logprobs_are_per_token_and_ranked(oai):
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=8, logprobs=True, top_logprobs=3, seed=5
    )
    content = r.choices[0].logprobs.content
    # items follow the visible text, not the token count: hidden control tokens have none,
    # and recipe's stream processor can hold a partial UTF-8 character's bytes into one item
    # (seen with the random model: 8 tokens, 7 items, the first item two bytes of a character)
    assert 0 < len(content) <= r.usage.completion_tokens
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob <= tops[0] + 1e-5 and item.logprob <= 0.0


def test_max_tokens_bounds_the_completion(oai):
    r = oai.chat.completions.create(model="deepseek-chat", messages=USER, max_tokens=3, seed=11)
    assert r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3


def test_stop_sequence_cuts_where_the_text_had_it(oai):
    kwargs = dict(model="deepseek-chat", messages=USER, max_tokens=40, temperature=0.0)
    free = oai.chat.completions.create(**kwargs).choices[0].message.content
    candidates = [
        free[i : i + 3] for i in range(4, len(free) - 3) if re.fullmatch("[A-Za-z]{3}", free[i : i + 3])
    ]
    assert candidates, f"no usable stop string in {free!r}"
    stop = candidates[len(candidates) // 2]
    cut = oai.chat.completions.create(stop=[stop], **kwargs)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == free[: free.index(stop)]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
        },
    },
}


def test_required_tool_choice_yields_a_valid_tool_call(oai):
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=300, seed=3,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["days"] in (1, 2, 3)


def test_json_schema_output_validates(oai):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "n": {"type": "integer", "enum": [1, 2]},
        },
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=200, seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )  # fmt: skip
    data = json.loads(r.choices[0].message.content)
    assert data["answer"] in ("yes", "no") and data["n"] in (1, 2) and set(data) == {"answer", "n"}


def test_json_object_output_parses(oai):
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=400, seed=2, temperature=0.0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_output_matches(oai):
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=USER, max_tokens=50, seed=4,
        response_format={"type": "regex", "regex": "(sunny|rainy) [0-9]{2}C"},
    )  # fmt: skip
    assert re.fullmatch(r"(sunny|rainy) [0-9]{2}C", r.choices[0].message.content)


def test_prefix_cache_hits_are_reported(oai):
    """Turn two extends turn one's prompt: its tokens come from the prefix cache."""
    turn1 = [{"role": "user", "content": "weather json report " * 150}]
    first = oai.chat.completions.create(model="deepseek-chat", messages=turn1, max_tokens=1, seed=1)
    turn2 = turn1 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and tomorrow?"}]
    second = oai.chat.completions.create(model="deepseek-chat", messages=turn2, max_tokens=1, seed=1)
    assert first.usage.prompt_tokens > 512 and second.usage.prompt_tokens > first.usage.prompt_tokens
    hit = (second.usage.model_extra or {})["prompt_cache_hit_tokens"]
    assert 512 <= hit <= first.usage.prompt_tokens  # at least the two full blocks of turn one
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    assert (second.usage.model_extra or {})["prompt_cache_miss_tokens"] == second.usage.prompt_tokens - hit


def test_completions_non_streaming_and_streaming(oai):
    r = oai.completions.create(model="deepseek-chat", prompt="The weather today", max_tokens=6, seed=3)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6
    streamed = list(oai.completions.create(model="deepseek-chat", prompt="The weather today", max_tokens=6,
                                           seed=3, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_ignore_eos_runs_a_completion_to_max_tokens(oai):
    """vLLM's ``ignore_eos`` extension (what load generators send for fixed-length outputs):
    greedy, this prompt ends at the model's EOS well before 400 tokens; with it, it does not."""
    kwargs = {"model": "deepseek-chat", "prompt": [2, 3, 4, 5], "max_tokens": 400, "temperature": 0}
    free = oai.completions.create(**kwargs)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 400
    full = oai.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 400
    with pytest.raises(openai.BadRequestError, match="ignore_eos must be a boolean"):
        oai.completions.create(extra_body={"ignore_eos": "yes"}, **kwargs)


def test_responses_non_streaming_and_streaming(oai):
    r = oai.responses.create(model="deepseek-chat", input="Describe the weather.", max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    assert r.usage.input_tokens > 0
    events = list(oai.responses.create(model="deepseek-chat", input="Describe the weather.",
                                       max_output_tokens=8, stream=True))  # fmt: skip
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens <= 8


def test_anthropic_messages_non_streaming_and_streaming(claude):
    msg = claude.messages.create(
        model="deepseek-chat", max_tokens=8, messages=[{"role": "user", "content": "Weather?"}]
    )
    assert msg.role == "assistant" and msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 8
    with claude.messages.stream(
        model="deepseek-chat", max_tokens=8, messages=[{"role": "user", "content": "Weather?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens <= 8 and text == "".join(
        b.text for b in final.content if b.type == "text"
    )


def test_anthropic_tool_use(claude):
    tool = {
        "name": "get_weather",
        "description": "Weather",
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
    msg = claude.messages.create(
        model="deepseek-chat", max_tokens=300, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )  # fmt: skip
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].input["city"] in ("Paris", "Oslo")


def test_data_url_image_is_accepted(oai):
    from tests.unit.api.images_fixtures import data_url, png

    content = [{"type": "text", "text": "What is in this image?"},
               {"type": "image_url", "image_url": {"url": data_url(png(16, 16))}}]  # fmt: skip
    r = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": content}],
                                    max_tokens=3)  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 0


def test_engine_refusal_is_a_4xx_even_when_streaming(oai, api_server):
    """A regex that parses but whose automaton is too costly: the engine's compiler refuses it
    after its time limit, or (on a fast machine) llguidance's lexer gives up on the first
    token and only that request fails. The stream's headers wait for the first token, so
    either way this is a 400 and the engine keeps serving."""
    with pytest.raises(openai.BadRequestError) as exc:
        list(oai.chat.completions.create(
            model="deepseek-chat", messages=USER, max_tokens=5, stream=True,
            response_format={"type": "regex", "regex": "((a{100}){100}){100}"},
        ))  # fmt: skip
    assert "regex" in str(exc.value) and api_server.engine.stats().running == 0
    ok = oai.chat.completions.create(model="deepseek-chat", messages=USER, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")  # the engine still serves
