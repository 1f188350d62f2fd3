"""``sluice bench router --profile-decode`` (`run_profile_decode`): the decode step-time table
measured on the engine, which grades the router's decode-balance runs and which its decode
cost model is fitted to (``router/data/decode_step_table.json``, ``router.steptable``).

`profile_decode` builds the engine's model runner (`_model_config`, seeded random weights,
`_fill_caches`), times one decode step at every cell of a grid of running sequences x total
KV tokens (`_time_cells`, each cell's batch from `_batch`), and returns the table with what
ran it (`_machine`) and the command that remeasures it (`_command`). ``sluice bench engine
--profile`` and ``--online-fit`` (`services.bench._decode_online`) call it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.bench import Report, progress

# --profile-decode grid: running sequences x total KV tokens of the engine (per sequence:
# total / batch). It spans the simulated decode engine's limits (256 sequences, 8M tokens).
PROFILE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILE_KV = (0, 262_144, 1_048_576, 2_097_152, 4_194_304, 8_388_608)


def profile_decode(
    preset: str = "tiny",
    batches: tuple[int, ...] = PROFILE_BATCH,
    kv_tokens: tuple[int, ...] = PROFILE_KV,
    rounds: int = 2,
    repeats: int = 5,
    warmup: int = 2,
    threads: int = 1,
    model_dir: Path | None = None,
    device: str = "cpu",
    layers: int | None = None,
    fill_caches: bool = True,
) -> dict[str, Any]:
    """Median seconds of one decode step of the engine's model runner over (batch, total KV).

    The runner is built from the preset's config (or ``model_dir``'s; ``layers`` resizes the
    preset) with seeded random weights (``ModelRunner.random``) on ``device``: fp32 on the
    CPU; bf16 on CUDA, where decode steps run as the engine runs them (CUDA graphs per batch
    bucket, captured during the warm-up steps) and each timed step ends with a
    synchronisation. A cell runs ``batch`` sequences of one new token each, every sequence
    ``kv_tokens // batch`` tokens deep (at least 1) in its own blocks, so a step reads
    ``kv_tokens`` tokens of compressed state. The blocks hold seeded random entries
    (``_fill_caches``; ``fill_caches=False`` leaves them zeroed, for an A/B): the indexer's
    cost depends on the scores it ranks, not only on the cache's shape. The sequences'
    tokens are distinct ids drawn over the vocabulary, so the routed experts a step reads
    are those of a batch of different requests. ``rounds`` passes go over the
    whole grid; in each, a cell runs ``warmup`` untimed steps and then ``repeats`` timed
    steps back to back (as an engine steps one batch after another), and each cell keeps
    the median of its ``rounds * repeats`` timings: a burst of load on the shared machine
    hits one pass, not every sample of one cell.
    """
    import torch

    from engine.runner import ModelRunner, RunnerConfig  # (the engine) before the wall clock starts

    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    mcfg = _model_config(preset, model_dir, layers)
    per_seq = {(b, k): max(k // b, 1) for b in batches for k in kv_tokens}
    cuda = device.startswith("cuda")
    rcfg = RunnerConfig(
        num_blocks=max(b * _seq_blocks(per_seq[b, k]) for b, k in per_seq), num_slots=max(batches),
        with_mtp=False, device=device, dtype="bfloat16" if cuda else "float32",
    )  # fmt: skip
    runner = ModelRunner.random(mcfg, rcfg, seed=0)
    if fill_caches:
        _fill_caches(runner, seed=0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = _token_ids(mcfg.vocab_size, max(batches))
    timings = _time_cells(
        runner, tokens, per_seq, batches, kv_tokens, rounds=rounds, repeats=repeats, warmup=warmup, sync=sync
    )
    seconds = [[statistics.median(timings[b, k]) for k in kv_tokens] for b in batches]
    spread = [[_relative_iqr(timings[b, k]) for k in kv_tokens] for b in batches]
    return {
        "kind": "decode_step_table",
        "preset": preset if model_dir is None else None,
        "model": str(model_dir) if model_dir is not None else None,
        "layers": mcfg.num_hidden_layers,
        "weights": "random (ModelRunner.random, seed 0)",
        "caches": "seeded random entries" if fill_caches else "zeroed",
        "dtype": runner.cfg.dtype,
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "decode_graphs": runner.graphs is not None,
        **_machine(),
        "statistic": f"median of {rounds} rounds x {repeats} back-to-back steps per cell, "
        f"after {warmup} untimed steps",
        "rounds": rounds,
        "repeats": repeats,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": _command(preset, rounds, repeats, device, layers, kv_tokens, fill_caches),
        "batch": list(batches),
        "kv_tokens": list(kv_tokens),
        "kv_tokens_per_sequence": [[per_seq[b, k] for k in kv_tokens] for b in batches],
        "seconds": seconds,
        "relative_iqr": [[round(x, 4) for x in row] for row in spread],
    }


def _model_config(preset: str, model_dir: Path | None, layers: int | None) -> Any:
    """The ``ModelConfig`` of ``model_dir``'s ``config.json``, else of ``preset`` (resized to
    ``layers`` layers when given)."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig

    if model_dir is not None:
        raw = json.loads((model_dir / "config.json").read_text())
    else:
        raw = preset_config(preset, **({"num_hidden_layers": layers} if layers else {}))
    return ModelConfig.from_dict(raw)


def _seq_blocks(depth: int) -> int:
    """Cache blocks of one sequence ``depth`` tokens deep (its new token included)."""
    from engine.config import BLOCK_TOKENS

    return depth // BLOCK_TOKENS + 1


def _token_ids(vocab_size: int, n: int) -> Any:
    """One token per sequence, spread over the vocabulary (seeded): the hash-MoE layers route
    by token id and the top-k layers by hidden state, so a batch of a few distinct tokens
    would read a few experts where real traffic reads many."""
    import torch

    return torch.randint(1, vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def _batch(token_ids: Any, b: int, depth: int) -> Any:
    """A ``ForwardBatch`` of ``b`` sequences, ``depth`` tokens deep each in blocks of its own,
    sequence ``i`` decoding ``token_ids[i]`` in SWA slot ``i``."""
    from engine.forward_batch import ForwardBatch, SequenceInput

    n = _seq_blocks(depth)
    seqs = [SequenceInput([int(token_ids[i])], depth, i, range(i * n, (i + 1) * n)) for i in range(b)]
    return ForwardBatch.from_sequences(seqs)


def _time_cells(
    runner: Any,
    token_ids: Any,
    per_seq: dict[tuple[int, int], int],
    batches: tuple[int, ...],
    kv_tokens: tuple[int, ...],
    *,
    rounds: int,
    repeats: int,
    warmup: int,
    sync: Callable[[], None],
) -> dict[tuple[int, int], list[float]]:
    """Seconds of each timed step of every (batch, total KV) cell: ``rounds`` passes over the
    grid, in each ``warmup`` untimed steps of a cell, then ``repeats`` timed ones back to back."""
    cells = [(b, k) for b in batches for k in kv_tokens]
    timings: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    for r in range(rounds):
        for b, k in cells:
            fb = _batch(token_ids, b, per_seq[b, k])
            for _ in range(warmup):  # the batch's blocks into cache, the allocator's sizes, graphs
                runner.execute(fb)
            sync()
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.execute(fb)
                sync()
                timings[b, k].append(time.perf_counter() - t0)
        progress(f"profile-decode: round {r + 1}/{rounds} done, load average {os.getloadavg()}")
    return timings


def _relative_iqr(x: list[float]) -> float:
    """Interquartile range / median."""
    q = statistics.quantiles(x, n=4)
    return (q[2] - q[0]) / statistics.median(x)


def _machine() -> dict[str, Any]:
    """The host and software that ran the steps, and when (UTC)."""
    import torch

    return {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _command(
    preset: str,
    rounds: int,
    repeats: int,
    device: str,
    layers: int | None,
    kv_tokens: tuple[int, ...],
    fill_caches: bool,
) -> str:
    """The ``--profile-decode`` command line that measures this table again."""
    return (
        f"python -m services.cli bench router --profile-decode --preset {preset} "
        f"--rounds {rounds} --repeats {repeats}"
        + (f" --device {device}" if device.startswith("cuda") else "")
        + (f" --layers {layers}" if layers else "")
        + ("" if tuple(kv_tokens) == PROFILE_KV else f" --kv-tokens {','.join(map(str, kv_tokens))}")
        + ("" if fill_caches else " --zeroed-caches")
    )


def _fill_caches(runner: Any, seed: int) -> None:
    """Seeded random entries in every compressed-cache block (the attention rows and the
    indexer's keys) in place of zeros: the indexer's top-k sorts every entry's score each
    step, and a sort of equal scores (zero keys) runs several times faster than one of a
    real cache's varied scores (torch.sort on CPU: 5.6x at 16 x 4,096), so a profile over
    zeroed blocks underprices the per-KV-token cost."""
    import torch

    for store in (*runner.pool.rows.values(), *runner.pool.index_rows.values()):
        store.normal_(generator=torch.Generator(device=store.device).manual_seed(seed))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_profile_decode(args: argparse.Namespace) -> Report:
    """``--profile-decode``: measure the table (``--preset``/``--layers``/``--device``,
    ``--kv-tokens``, ``--rounds``/``--repeats``, ``--zeroed-caches``), write it to
    ``--step-table``, and report it with one row per batch size."""
    kv = tuple(int(k) for k in args.kv_tokens.split(",")) if args.kv_tokens else PROFILE_KV
    table = profile_decode(
        args.preset,
        kv_tokens=kv,
        rounds=args.rounds,
        repeats=args.repeats,
        device=args.device,
        layers=args.layers,
        fill_caches=not args.zeroed_caches,
    )
    out = Path(args.step_table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    report = Report("router", config={"mode": "profile-decode", "out": str(out)} | {
        k: table[k] for k in ("preset", "layers", "device", "gpu", "cpu", "torch", "torch_threads", "rounds",
                              "repeats", "caches", "batch", "kv_tokens")
    })  # fmt: skip
    report.results["decode_step_table"] = table
    for b, row in zip(table["batch"], table["seconds"]):
        report.rows.append(
            {"batch": b, **{f"kv {k:,}": f"{s * 1e3:.2f} ms" for k, s in zip(table["kv_tokens"], row)}}
        )
    return report
