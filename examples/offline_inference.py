"""Offline inference end to end: Sluice's counterpart of DeepInfer's examples/offline_inference.py.

    python examples/offline_inference.py                 # the shipped trained preset (models/trained)
    SLUICE_MODEL_DIR=/weights/V4.1-Flash python examples/offline_inference.py
    python examples/offline_inference.py --model DIR --max-tokens 32
    python examples/offline_inference.py --preset tiny   # a random preset, generated on first use

The trained preset is a small DeepSeek-V4 trained on the Python standard library: it
continues Python source and answers chats with Python-like text. Random presets are
generated under $SLUICE_HOME/checkpoints/NAME on first use (their text is gibberish, the
pipeline is real). Shows plain prompts, a chat prompt rendered by deepseek-recipe, a seeded
sampled request and a JSON-schema-constrained one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine import LLM, SamplingParams, StructuredOutput  # noqa: E402
from engine.checkpoint.presets import DEFAULT_PRESET, preset_names, resolve_preset  # noqa: E402
from services import envs  # noqa: E402


def model_dir(arg: str | None, preset: str | None = None) -> Path:
    """--model, else --preset, else $SLUICE_MODEL_DIR, else the shipped trained preset."""
    if arg:
        return Path(arg)
    if preset is None:
        env = envs.MODEL_DIR.get()
        if env is not None:
            return env
        preset = DEFAULT_PRESET
    return resolve_preset(preset, envs.HOME.get())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--model", help=f"checkpoint directory (default: $SLUICE_MODEL_DIR, else the {DEFAULT_PRESET} preset)"
    )
    which.add_argument("--preset", choices=preset_names(), help="a preset instead of a directory")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    llm = LLM(
        model_dir(args.model, args.preset),
        device=args.device,
        num_blocks=64,
        num_swa_slots=16,
        max_num_seqs=8,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=args.max_tokens, logprobs=2)
        schema = {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        }
        constrained = SamplingParams(
            temperature=0.0, max_tokens=32, structured=StructuredOutput(json_schema=json.dumps(schema))
        )
        prompts = ["def fibonacci(n):\n", "import os\n"]
        outs = llm.generate(prompts, [greedy, seeded])
        for out in outs:
            c = out.outputs[0]
            print(
                f"prompt={out.prompt!r}\n  -> {c.text!r} ({len(c.token_ids)} tokens, finish={c.finish_reason})"
            )
        chat = llm.chat([{"role": "user", "content": "Say hello."}], greedy)[0]
        print(f"chat ({len(chat.prompt_token_ids)} prompt tokens) -> {chat.outputs[0].text!r}")
        js = llm.generate("Answer in JSON:", constrained)[0].outputs[0]
        print(f"json_schema -> {js.text} (valid JSON: {json.loads(js.text) is not None})")
        # A follow-up turn extends prompt 1 and its answer: the retained SWA slot and cached
        # blocks are reused exactly, so only the new tokens are computed.
        first = outs[0]
        follow = first.prompt_token_ids + first.outputs[0].token_ids + llm.tokenizer.encode(" And").ids
        again = llm.generate(prompt_token_ids=[follow], sampling_params=greedy)[0]
        print(
            f"follow-up turn: {again.num_cached_tokens} of {len(follow)} prompt tokens from the prefix cache"
        )
        stats = llm.scheduler.cache.blocks.stats
        print(
            f"prefix cache: {stats.hit_blocks}/{stats.query_blocks} blocks hit, SWA slots reused {llm.scheduler.cache.slots.reused}"
        )
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
