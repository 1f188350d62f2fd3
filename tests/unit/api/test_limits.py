import pytest

from services.api.config import ApiConfig
from services.api.errors import ApiError
from services.api.limits import check_body, parse_json_object
from services.api.tool_grammar import tool_call_grammar
from tests.unit.api.images_fixtures import data_url, png

CFG = ApiConfig(max_tools=2, max_schema_bytes=200, max_regex_chars=20, max_images=1, max_prompt_chars=1000)
MSG = [{"role": "user", "content": "hello json"}]


def rejected(body, kind="chat", cfg=CFG) -> ApiError:
    with pytest.raises(ApiError) as exc:
        check_body(body, kind, cfg)
    assert 400 <= exc.value.status < 500
    return exc.value


@pytest.mark.parametrize("raw", [b"", b"   ", b"{oops", b"[1, 2]", b"null", b'"text"', b"[" * 100_000])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(ApiError) as exc:
        parse_json_object(raw)
    assert exc.value.status == 400 and exc.value.param == "body"


def test_generation_bounds_name_their_limit():
    assert rejected({"messages": MSG, "n": 5}).param == "max_n"
    assert rejected({"messages": MSG, "max_tokens": 10**9}).param == "max_tokens_limit"
    assert rejected({"messages": MSG, "max_completion_tokens": 10**6}).param == "max_tokens_limit"
    assert rejected({"input": "x", "max_output_tokens": 10**6}, "responses").param == "max_tokens_limit"
    assert rejected({"messages": MSG, "top_logprobs": 300}).param == "max_top_logprobs"
    assert rejected({"prompt": "x", "logprobs": 21}, "completions").param == "max_top_logprobs"
    assert rejected({"messages": MSG, "stop": ["x"] * 17}).param == "max_stop_sequences"
    assert rejected({"messages": MSG, "stop": "y" * 300}).param == "max_stop_chars"
    assert rejected({"messages": MSG, "max_tokens": "many"}).param == "max_tokens"
    assert rejected({"messages": MSG, "max_tokens": 0}).param == "max_tokens"
    check_body({"messages": MSG, "max_tokens": 10, "n": 1, "top_logprobs": 20}, "chat", CFG)
    check_body({"messages": MSG, "max_tokens": 10**6}, "messages", CFG)  # Messages lowers it instead


def test_tools_schema_and_regex_limits_and_validity():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert rejected({"messages": MSG, "tools": [tool] * 3}).param == "max_tools"
    huge = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["v" * 300]}}}
    assert rejected({"messages": MSG, "response_format": huge}).param == "max_schema_bytes"
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}
    assert "invalid json schema" in rejected({"messages": MSG, "response_format": bad}).message
    assert rejected({"messages": MSG, "response_format": {"type": "regex", "regex": "[a-z+"}}).param == (
        "response_format.regex"
    )
    assert rejected({"messages": MSG, "response_format": {"type": "regex", "regex": "a" * 21}}).param == (
        "max_regex_chars"
    )
    fmt = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}
    assert rejected({"input": "x", "text": fmt}, "responses").status == 400
    check_body({"messages": MSG, "response_format": {"type": "regex", "regex": "[a-z]+"}}, "chat", CFG)


def test_images_are_counted_and_measured_in_every_protocol_shape():
    small = data_url(png(2, 2))
    bomb = data_url(png(60_000, 60_000))
    chat = {"type": "image_url", "image_url": {"url": small}}
    assert rejected({"messages": [{"role": "user", "content": [chat, chat]}]}).param == "max_images"
    chat_bomb = {"type": "image_url", "image_url": {"url": bomb}}
    assert rejected({"messages": [{"role": "user", "content": [chat_bomb]}]}).param in (
        "max_image_pixels", "max_image_side_px",
    )  # fmt: skip
    resp = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": bomb}]}]}
    assert rejected(resp, "responses").status == 400
    b64 = bomb.split(",", 1)[1]
    anth = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    assert (
        rejected({"max_tokens": 5, "messages": [{"role": "user", "content": [anth]}]}, "messages").status
        == 400
    )
    remote = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}
    assert rejected({"messages": [{"role": "user", "content": [remote]}]}).param == "allow_remote_images"
    facts = check_body({"messages": [{"role": "user", "content": [chat]}]}, "chat", CFG)
    assert len(facts.images) == 1


def test_prompt_text_is_bounded_before_tokenising():
    assert rejected({"messages": [{"role": "user", "content": "z" * 2000}]}).param == "max_prompt_chars"


def test_config_validation_is_actionable(tmp_path):
    with pytest.raises(ValueError, match="max_concurrency"):
        ApiConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="IP literals"):
        ApiConfig(image_url_allow_hosts=("127.0.0.1",))
    keys = tmp_path / "keys"
    keys.write_text("# ops\nkey-one\n\nkey-two\n")
    cfg = ApiConfig(api_keys=("env-key",), api_keys_file=keys).resolve("tiny", 8192)
    assert cfg.api_keys == ("env-key", "key-one", "key-two") and cfg.context_limit == 8192
    assert cfg.model_names[0] == "tiny" and "deepseek-chat" in cfg.model_names
    assert "env-key" not in repr(cfg)


def _matcher_accepts(grammar_text: str, text: str, tokenizer_json) -> bool:
    import llguidance
    from deepseek_recipe import Tokenizer

    ll_tok = llguidance.LLTokenizer(tokenizer_json.read_text(), eos_token=1)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.grammar_from("lark", grammar_text))
    for token in Tokenizer.from_file(str(tokenizer_json)).encode(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_tool_grammar_accepts_a_declared_call_and_nothing_else(tmp_path):
    from engine.checkpoint.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, 1024)
    tok = tmp_path / "tokenizer.json"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]  # fmt: skip
    grammar = tool_call_grammar(tools)
    head = '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    tail = "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    days = '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    assert _matcher_accepts(grammar, head + days + tail, tok)
    assert _matcher_accepts(grammar, head + tail, tok)  # the optional parameter may be left out
    assert not _matcher_accepts(grammar, head.replace("get_weather", "rm_rf") + tail, tok)
    assert not _matcher_accepts(grammar, head + days.replace(">3<", ">three<") + tail, tok)  # not JSON
    assert not _matcher_accepts(grammar, days + tail, tok)  # the required parameter is missing
    with pytest.raises(ValueError):
        tool_call_grammar([])


def test_thinking_mode_constraint_applies_after_the_reasoning(tmp_path):
    from deepseek_recipe import Tokenizer

    from engine.checkpoint.tokenizer import write_tokenizer
    from services.api.convert import _after_reasoning

    write_tokenizer(tmp_path, 1024)
    tok = tmp_path / "tokenizer.json"
    (think_end,) = Tokenizer.from_file(str(tok)).encode("</think>")
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    grammar = _after_reasoning(think_end, f"%json {schema}")
    assert _matcher_accepts(grammar, 'free {not json} reasoning</think>{"a": 12}', tok)
    assert not _matcher_accepts(grammar, 'reasoning</think>{"a": "x"}', tok)  # answer violates the schema
    assert not _matcher_accepts(grammar, '{"a": 12}', tok)  # no end of reasoning: not complete
