"""The shipped ``trained`` preset (``models/trained``): resolved, loadable, and what it says.

It is a real trained model, so besides the checks every preset gets (transformers loads it
with nothing left at its own init; the engine's greedy tokens equal transformers'), these
tests hold it to being trained: it scores held-in Python better than a bigram model would,
and its greedy continuation of Python is Python-like. A random or broken checkpoint fails
them. The engine runs it in its default dtype (fp32 on CPU, from the bf16 file), against
transformers in fp32.
"""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.checkpoint.presets import DEFAULT_PRESET, SHIPPED, preset_config, resolve_preset
from tests.unit.engine.test_llm import assert_hf_greedy

ROOT = Path(__file__).resolve().parents[3]
TRAINED = ROOT / "models" / "trained"
BOS = 0
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]
MAX_TOKENS = 32
# A few lines in the standard library's style: the trained model's loss on them, per token.
SNIPPET = '''def _check_name(name):
    """Raise ValueError if name is not a valid identifier."""
    if not isinstance(name, str):
        raise TypeError("name must be a string")
    for i, ch in enumerate(name):
        if ch == "." and i > 0:
            return False
    return True
'''
BIGRAM_NLL = 4.37  # ln(79.0): the corpus's held-out bigram perplexity (models/trained/training.json)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TRAINED / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_fp32():
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(TRAINED, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    with LLM(TRAINED, num_blocks=16, num_swa_slots=8, max_num_seqs=8) as engine:
        yield engine


def test_trained_is_the_default_shipped_preset(tmp_path):
    assert DEFAULT_PRESET == "trained" and SHIPPED["trained"] == TRAINED
    assert resolve_preset("trained", tmp_path) == TRAINED
    assert not (tmp_path / "checkpoints").exists()  # nothing generated for a shipped preset
    with pytest.raises(ValueError, match="shipped"):
        preset_config("trained")  # gen-checkpoint's generator refuses it


def test_a_missing_shipped_preset_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(SHIPPED, "trained", tmp_path / "absent")
    with pytest.raises(ValueError, match="shipped preset 'trained' is missing"):
        resolve_preset("trained", tmp_path)


def test_random_presets_are_generated_once_under_home(tmp_path):
    path = resolve_preset("tiny", tmp_path)
    assert path == tmp_path / "checkpoints" / "tiny" and (path / "tokenizer.json").is_file()
    mtime = (path / "config.json").stat().st_mtime_ns
    assert resolve_preset("tiny", tmp_path) == path
    assert (path / "config.json").stat().st_mtime_ns == mtime  # reused, not regenerated
    with pytest.raises(ValueError, match="unknown preset 'nope'.*trained"):
        resolve_preset("nope", tmp_path)


def test_config_covers_every_component_and_the_file_is_small():
    cfg = json.loads((TRAINED / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert set(cfg["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert {"hash_moe", "moe"} <= set(cfg["mlp_layer_types"])
    assert cfg["sliding_window"] == 128 and cfg["index_topk"] < 1024
    assert cfg["num_nextn_predict_layers"] == 1 and (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    assert (TRAINED / "model.safetensors").stat().st_size <= 20_000_000
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (TRAINED / name).is_file(), name


def test_loads_in_transformers_with_every_key_from_the_file():
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(TRAINED).eval()  # the file's dtype (bf16)
    with torch.no_grad():
        logits = model(torch.tensor([list(range(3, 67))])).logits
    assert logits.shape[-1] == json.loads((TRAINED / "config.json").read_text())["vocab_size"]
    assert torch.isfinite(logits).all()
    with safe_open(TRAINED / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert set(model.state_dict()) <= keys  # nothing left at transformers' own init
    assert any(k.startswith("mtp.0.") for k in keys)  # the MTP layer is shipped too


def test_it_is_trained_it_beats_a_bigram_model_on_python(hf_fp32, tokenizer):
    ids = [BOS, *tokenizer.encode(SNIPPET, add_special_tokens=False).ids]
    with torch.no_grad():
        logits = hf_fp32(torch.tensor([ids]), use_cache=False).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert nll < BIGRAM_NLL - 0.5, f"{nll:.2f} nats/token"  # random weights: ~9


def test_engine_greedy_equals_transformers_and_continues_python(llm, hf_fp32, tokenizer):
    prompts = [[BOS, *tokenizer.encode(p, add_special_tokens=False).ids] for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    words = set(keyword.kwlist) | {"self"}
    distinct: set[int] = set()
    for text, prompt, out in zip(PROMPTS, prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == MAX_TOKENS
        assert_hf_greedy(hf_fp32, prompt, tokens)
        continuation = tokenizer.decode(tokens)
        found = words & set(re.findall(r"[A-Za-z_]+", continuation))
        assert "\n" in continuation and found, f"{text!r} -> {continuation!r}"
        distinct.update(tokens)
    # Greedy continuations of this small model can loop on one line ("import re" repeated,
    # docs/training.md), but a working checkpoint does not answer every prompt with a few ids.
    assert len(distinct) >= 16, distinct


def test_chat_renders_with_recipe_and_answers_without_control_tokens(llm):
    tok = llm.tokenizer
    out = llm.chat(
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )[0]
    prompt = out.prompt_token_ids
    assert prompt[0] == BOS
    assert tok.token_to_id("<｜User｜>") in prompt and tok.token_to_id("<｜Assistant｜>") in prompt
    text = out.outputs[0].text
    assert text.strip(), out.outputs[0]
    assert "<｜" not in text and "<|" not in text, text
