"""The generated tokenizers hold every special token deepseek-recipe's V4 and V4.1 encodings emit."""

import deepseek_recipe as dr
import pytest
from tokenizers import Tokenizer

from engine.checkpoint.tokenizer import SYSTEM_TOKEN, recipe_special_tokens, write_tokenizer


@pytest.fixture(scope="module", params=[None, 1024], ids=["full", "tiny"])
def tokenizer_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    info = write_tokenizer(out, vocab_limit=request.param)
    return out, info


def _conversations():
    tool = dr.ToolDefinition(
        name="get_weather",
        description="Weather for a city",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
    for thinking in (True, False):
        yield dr.Conversation(
            [
                dr.SystemMessage("You are terse."),
                dr.UserMessage("Weather in Paris?"),
                dr.AssistantMessage(
                    "",
                    reasoning_content="Call the tool.",
                    tool_calls=[dr.ToolCall("c1", "get_weather", '{"city": "Paris"}')],
                ),
                dr.ToolMessage("18C", tool_call_id="c1"),
                dr.UserMessage("Thanks."),
            ],
            thinking_mode=thinking,
            tools=[tool],
        )


def test_every_recipe_special_token_is_one_id(tokenizer_dir):
    out, info = tokenizer_dir
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == info.vocab_size
    for special in recipe_special_tokens():
        ids = tok.encode(special, add_special_tokens=False).ids
        assert len(ids) == 1, special
        assert tok.decode(ids, skip_special_tokens=False) == special
    assert tok.token_to_id(SYSTEM_TOKEN) == info.system_token_id


@pytest.mark.parametrize("encoding", [dr.DeepseekV4Encoding, dr.DeepseekV41Encoding])
def test_recipe_prompts_round_trip(tokenizer_dir, encoding):
    out, info = tokenizer_dir
    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = encoding().with_tokenizer(dr.Tokenizer.from_file(str(out / "tokenizer.json")))
    specials = set(recipe_special_tokens())
    for conv in _conversations():
        prompt = enc.render_conversation(conv).prompt
        ids = enc.encode(conv)
        assert max(ids) < info.vocab_size
        assert hf.decode(ids, skip_special_tokens=False) == prompt
        emitted = {s for s in specials if s in prompt}
        assert emitted, "the rendered prompt should contain special tokens"
        id_set = set(ids)
        for s in emitted:
            assert hf.token_to_id(s) in id_set, s


def test_full_vocabulary_keeps_the_released_ids(tmp_path):
    info = write_tokenizer(tmp_path)
    assert info.vocab_size == 129280
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.token_to_id("<｜User｜>") == 128803
    assert tok.token_to_id("<｜Assistant｜>") == 128804
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == 1
