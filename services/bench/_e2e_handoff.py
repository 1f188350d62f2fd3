"""One long-prompt handoff on the real engine: payload bytes against the cache formula.

``sluice bench e2e --handoff-only`` (and the ``handoff_131k`` section of the full report):

1. a ``tiny`` checkpoint whose ``max_position_embeddings`` is raised so the prompt fits (the
   shipped ``tiny`` preset stops at 8,192 positions; the cache layout per token does not
   depend on the context limit, so the bytes per token are those of ``tiny``), generated
   once into ``<SLUICE_HOME>/checkpoints/tiny-ctx<N>``;
2. engine A (``EngineCore``, CPU, fp32) prefills a prompt of ``--handoff-tokens`` token ids
   in chunks of ``--handoff-chunk`` tokens until it samples the first token; each step is
   timed;
3. ``EngineCore.export_sequence`` on A (timed), ``import_sequence`` on a second engine B
   (timed), then B decodes the next token (checks the handoff continues);
4. payload bytes against the cache formula, as for the replay's handoffs.

Overlap: the export runs after the step that sampled the first token
(``engine/kvconnector/transfer.py``: it refuses a sequence with a step in flight), and it
reads every layer's blocks from the finished cache, so no byte moves while the prefill
computes. The report says so in ``overlap``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from services.bench import progress

PROMPT_LOW, PROMPT_HIGH = 10, 1000
OVERLAP_STATEMENT = (
    "no: the sequence is exported after the step that samples the first token (export_sequence "
    "refuses a sequence with a step in flight) and the export reads every layer's blocks from the "
    "finished cache, so the whole transfer time follows the whole prefill. Layer by layer overlap "
    "would need the prefill's last chunk to publish each layer's new blocks as that layer finishes "
    "(a per-layer hook in the model runner) and a transport that sends blocks while later layers "
    "compute, with the decode engine assembling the sequence from per-layer parts."
)


def long_context_model(home: Path, tokens: int) -> Path:
    """A tiny checkpoint with room for ``tokens`` prompt tokens plus a few outputs."""
    from engine.checkpoint.generate import generate_checkpoint

    positions = 1 << max(13, (tokens + 64).bit_length())  # a power of two above the prompt
    path = Path(home) / "checkpoints" / f"tiny-ctx{positions}"
    if not (path / "config.json").is_file():
        progress(f"handoff: generating a tiny checkpoint with {positions} positions in {path}")
        generate_checkpoint("tiny", path, seed=0, max_position_embeddings=positions)
    return path


def run_handoff(model: Path, tokens: int, chunk: int, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    import random

    from engine.config import BLOCK_TOKENS
    from engine.core import CoreRequest, EngineConfig, EngineCore
    from engine.sampling.params import SamplingParams
    from services.bench._e2e_real import _handoff_bytes

    blocks = -(-(tokens + 8) // BLOCK_TOKENS) + 8
    cfg: dict[str, Any] = {
        "model": str(model), "num_blocks": blocks, "max_num_batched_tokens": chunk,
        "num_swa_slots": 4, "max_num_seqs": 4, "enable_prefix_caching": False, "device": device,
    }  # fmt: skip
    a, b = EngineCore(EngineConfig(**cfg)), EngineCore(EngineConfig(**cfg))
    rng = random.Random(f"handoff:{seed}")
    prompt = tuple(rng.randrange(PROMPT_LOW, PROMPT_HIGH) for _ in range(tokens))
    rid = "handoff-long"
    a.add(CoreRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    steps: list[float] = []
    first: list[int] = []
    t0 = time.perf_counter()
    while not first:
        ts = time.perf_counter()
        for o in a.step():
            if o.request_id == rid:
                first += o.new_token_ids
        steps.append(time.perf_counter() - ts)
        progress(
            f"handoff: prefill step {len(steps)}: {steps[-1]:.1f} s ({time.perf_counter() - t0:.1f} s in all)"
        )
        if len(steps) > 4 * (tokens // chunk + 8):
            raise RuntimeError(f"handoff: no first token after {len(steps)} steps")
    prefill_s = time.perf_counter() - t0
    te = time.perf_counter()
    payload = a.export_sequence(rid)
    export_s = time.perf_counter() - te
    for o in a.take_outputs():  # steps drained by the export
        if o.request_id == rid:
            first += o.new_token_ids
    ti = time.perf_counter()
    b.import_sequence(payload)
    import_s = time.perf_counter() - ti
    after: list[int] = []
    for _ in range(16):
        for o in b.step():
            if o.request_id == rid:
                after += o.new_token_ids
        if after:
            break
    progress(
        f"handoff: {tokens} tokens prefilled in {prefill_s:.1f} s ({len(steps)} steps), payload "
        f"{len(payload):,} B, export {export_s * 1e3:.1f} ms, import {import_s * 1e3:.1f} ms"
    )
    bytes_vs = _handoff_bytes(model, "float32", (float(len(payload)), 1.0), [tokens])
    chunk_steps = sorted(steps)
    return {
        "model": str(model),
        "preset": "tiny, max_position_embeddings raised (the cache bytes per token are tiny's)",
        "device": device,
        "dtype": "float32",
        "prompt_tokens": tokens,
        "chunk_tokens": chunk,
        "prefill_steps": len(steps),
        "prefill_s": prefill_s,
        "prefill_step_s": {"median": chunk_steps[len(chunk_steps) // 2], "max": chunk_steps[-1]},
        "payload_bytes": len(payload),
        "export_ms": export_s * 1e3,
        "import_ms": import_s * 1e3,
        "transfer_over_prefill": (export_s + import_s) / prefill_s if prefill_s > 0 else float("nan"),
        "first_tokens_on_prefill_engine": len(first),
        "decoded_after_import": len(after),
        "bytes": bytes_vs,
        "overlaps_compute_layer_by_layer": False,
        "overlap": OVERLAP_STATEMENT,
    }
