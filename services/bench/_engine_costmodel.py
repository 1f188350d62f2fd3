"""The prefill chunk cost model of `sluice bench engine --profile`: step times over a (chunk,
prefix) grid with random weights at a checkpoint's config, on any device (`profile_prefill`;
`GRID_C` x `GRID_H` on the CPU, `GPU_GRID_C` x `GPU_GRID_H` on a GPU), the fit of
``costmodel.CostModel``'s four terms, each >= 0, on relative error (`fit_cost_model`), and
its error on held-out shapes that the fit never saw (`heldout_error`; `HELDOUT_C` x
`HELDOUT_H`, `GPU_HELDOUT_C` x `GPU_HELDOUT_H`: other chunk sizes, and prefixes from none to
twice the grid's longest); `fit_and_grade` does all three for the bench."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from services.bench import progress

#: the CPU grid: chunks and prefixes of the sizes the CPU presets' engines run
GRID_C = (16, 64, 128, 256, 512)
GRID_H = (0, 256, 768)


#: the CPU's held-out shapes: no chunk and no prefix of the grid
HELDOUT_C = (32, 192, 384)
HELDOUT_H = (128, 512, 1536)

#: the prefill grid on a GPU: chunks and prefixes of the sizes a GPU engine runs
GPU_GRID_C = (256, 1024, 4096, 16384)
GPU_GRID_H = (1024, 4096, 8192, 32768)
#: the GPU's held-out shapes (chunks of 512, 2,048 and 8,192 tokens after a cached prefix of
#: 0, 16K and 64K tokens): no chunk and no prefix of the grid, the longest prefix twice its
GPU_HELDOUT_C = (512, 2048, 8192)
GPU_HELDOUT_H = (0, 16384, 65536)


Samples = list[tuple[int, int, float]]
#: a grid of step shapes: (chunk sizes, cached-prefix lengths)
Grid = tuple[tuple[int, ...], tuple[int, ...]]


class _Prefiller:
    """One sequence's prefill steps on ``device`` with seeded random weights at ``model_dir``'s
    config (bf16 on CUDA, fp32 elsewhere; a step's time depends on the shapes, not the values),
    with room for ``positions`` positions."""

    def __init__(self, model_dir: Path, device: str, positions: int) -> None:
        import torch

        from engine.config import BLOCK_TOKENS, ModelConfig
        from engine.runner import ModelRunner, RunnerConfig

        cuda = device.startswith("cuda")
        mcfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        blocks = -(-positions // BLOCK_TOKENS)
        rcfg = RunnerConfig(
            num_blocks=blocks,
            num_slots=1,
            with_mtp=False,
            device=device,
            dtype="bfloat16" if cuda else "float32",
        )
        self.runner = ModelRunner.random(mcfg, rcfg, seed=0)
        self.device = torch.device(device)
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.table = list(range(blocks))
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, mcfg.vocab_size, (positions,), generator=gen).tolist()

    def step(self, start: int, n: int) -> None:
        from engine.forward_batch import ForwardBatch, SequenceInput

        seq = SequenceInput(self.ids[start : start + n], start, 0, self.table)
        self.runner.execute(ForwardBatch.from_sequences([seq], device=self.device))

    def time_grid(self, chunks: tuple[int, ...], prefixes: tuple[int, ...], repeats: int) -> Samples:
        """(chunk, prefix, seconds) over the grid: each prefix is prefilled once, in steps of at
        most the largest chunk; each chunk is then timed ``repeats`` times at that prefix
        (synchronised; the minimum kept), after one untimed run."""
        samples = []
        for h in sorted(prefixes):
            for s0 in range(0, h, max(chunks)):
                self.step(s0, min(max(chunks), h - s0))
            for c in chunks:
                self.step(h, c)  # the chunk's shapes into the allocator; rewriting the same positions
                best = math.inf
                for _ in range(repeats):
                    self.sync()
                    t0 = time.perf_counter()
                    self.step(h, c)
                    self.sync()
                    best = min(best, time.perf_counter() - t0)
                samples.append((c, h, best))
                progress(f"profile-prefill: chunk {c} at prefix {h}: {best * 1e3:.2f} ms")
        return samples


def profile_prefill(
    model_dir: Path, device: str, chunks: tuple[int, ...], prefixes: tuple[int, ...], repeats: int
) -> Samples:
    """(chunk, prefix, seconds) of one sequence's prefill step over the grid (`_Prefiller`)."""
    return _Prefiller(model_dir, device, max(prefixes) + max(chunks)).time_grid(chunks, prefixes, repeats)


def profile_fit_and_heldout(
    model_dir: Path, device: str, fit: Grid, heldout: Grid, repeats: int, rounds: int
) -> tuple[Samples, Samples]:
    """The fit grid's and the held-out grid's samples (each a (chunks, prefixes) pair), timed
    in ``rounds`` alternating rounds (fit, held-out, fit, ...) of ``repeats`` timings per
    cell, each cell's minimum over all kept. A host whose speed drifts (a launch-bound step's
    time is the host's) then shifts both grids alike: measured one after the other, the fit
    and its grading can see two different machines (one H200 lease graded 0.33 where the
    next graded 0.07-0.17 on the same tree)."""
    positions = max(max(g[0]) + max(g[1]) for g in (fit, heldout))
    prefiller = _Prefiller(model_dir, device, positions)
    best: list[Samples] = [[], []]
    for r in range(rounds):
        for i, (chunks, prefixes) in enumerate((fit, heldout)):
            progress(f"profile-prefill: round {r + 1}/{rounds}, {('fit', 'held-out')[i]} grid")
            got = prefiller.time_grid(chunks, prefixes, repeats)
            best[i] = (
                got if not best[i] else [(c, h, min(t, u)) for (c, h, t), (_, _, u) in zip(best[i], got)]
            )
    return best[0], best[1]


def fit_and_grade(
    model_dir: Path, device: str, fit: Grid, heldout: Grid, repeats: int, rounds: int
) -> tuple[Any, dict[str, Any]]:
    """The cost model fitted on the ``fit`` grid (`fit_cost_model`) and its report, with its
    error on the ``heldout`` grid (`heldout_error`), both timed by `profile_fit_and_heldout`."""
    samples, held = profile_fit_and_heldout(model_dir, device, fit, heldout, repeats, rounds)
    report = fit_cost_model(samples)
    model = report.pop("model")
    report.update(heldout_error(model, held))
    return model, report


def _nonnegative_lstsq(x: Any, y: Any) -> Any:
    """min ||x w - y|| subject to w >= 0, exactly, for a few columns: the unconstrained
    solution of every subset of columns, keeping the best one whose weights are all >= 0.
    (Clipping the unconstrained solution's negative weights to 0 leaves the others fitted
    for a term that is gone.)"""
    import itertools

    import numpy as np

    cols = x.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(y * y))
    for k in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), k):
            idx = list(subset)
            w, *_ = np.linalg.lstsq(x[:, idx], y, rcond=None)
            if np.any(w < 0):
                continue
            err = float(np.sum((x[:, idx] @ w - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(cols), err
                best[idx] = w
    return best


def fit_cost_model(samples: list[tuple[int, int, float]]) -> dict[str, Any]:
    """The chunk cost model ``a*C*(C+H) + b*(C+H) + d*C + c`` (``costmodel.CostModel``, all four
    terms, each >= 0) by least squares on *relative* error (rows weighted by 1/t): the
    scheduler uses the model for small and large chunks alike, so a 10 ms step mispredicted
    by 10 ms matters as much as a 1 s step mispredicted by 1 s. ``CostModel.fit`` (absolute
    error) is reported too."""
    import numpy as np

    from costmodel import CostModel

    arr = np.asarray(samples, dtype=np.float64)
    c, h, t = arr[:, 0], arr[:, 1], arr[:, 2]
    x = np.stack([c * (c + h), c + h, c, np.ones_like(c)], axis=1) / t[:, None]  # [S, 4]
    a, b, d, c0 = (float(v) for v in _nonnegative_lstsq(x, np.ones_like(t)))
    if a == b == d == 0:
        raise ValueError(
            "the step times do not grow with the tokens a step computes, so there is no cost model "
            "to fit: the machine's noise is larger than the work (profile larger chunks, or with "
            "more repeats on an idle machine)"
        )
    model = CostModel(a=a, b=b, c=c0, d=d)
    rel = [(model.predict(c, h) - t) / t for c, h, t in samples]
    try:  # reported beside the fit; where it clips every term to 0 it has no error to report
        absolute = CostModel.fit(samples)
        abs_rel: float | None = math.sqrt(
            statistics.fmean(((absolute.predict(c, h) - t) / t) ** 2 for c, h, t in samples)
        )
    except ValueError:
        abs_rel = None
    return {
        "model": model,
        "samples_chunk_prefix_s": [list(s) for s in samples],
        "abs_fit_rel_rmse": abs_rel,
        "a": model.a,
        "b": model.b,
        "c": model.c,
        "d": model.d,
        "fit_rel_rmse": math.sqrt(statistics.fmean(r * r for r in rel)),
        "fit_max_rel_err": max(abs(r) for r in rel),
    }


def heldout_error(model: Any, samples: list[tuple[int, int, float]]) -> dict[str, Any]:
    """A fitted ``CostModel``'s relative error on step times it was not fitted to."""
    rel = [(model.predict(c, h) - t) / t for c, h, t in samples]
    return {
        "heldout_samples_chunk_prefix_s": [list(s) for s in samples],
        "heldout_rel_rmse": math.sqrt(statistics.fmean(r * r for r in rel)),
        "heldout_max_rel_err": max(abs(r) for r in rel),
    }
