"""`sluice bench vision`'s part 1, images/s per encoder instance: the spawned instance
(`_encoder_worker`, pinned to one core) and the parent that drives the rounds
(`encoder_report`: the images `_image_sets`, the rounds `_run_rounds` with the instances'
answers `_collect` and one row per round `_round_row`, the medians `_summary`).
`services.bench.vision`'s module doc says what is measured and how.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from services.bench import progress
from services.bench._vision_images import png, preprocess

SIZES: tuple[tuple[int, int], ...] = ((64, 48), (320, 240), (640, 480), (1024, 768))


def _encoder_worker(
    model_dir: str, core: int, parts: list[tuple[int, bytes, int, int]], commands: Any, results: Any
) -> None:
    """One encoder instance (a spawned process): pinned to ``core``, one torch thread, a
    cache-off ``VisionStage``. Runs a round per ``("run", start_at)`` command; ``None`` stops."""
    try:
        os.sched_setaffinity(0, {core})
        import torch

        torch.set_num_threads(1)
        from engine.vision.stage import ImagePart, VisionStage

        stage = VisionStage.from_model_dir(model_dir, cache_bytes=0)
        if stage is None:
            raise RuntimeError(f"{model_dir} has no vision encoder")
        images = [ImagePart(0, n, data, w, h) for n, data, w, h in parts]
        stage.encode(images[:1])  # warm-up
        results.put(("ready", core, None))
        while (cmd := commands.get()) is not None:
            _, start_at = cmd
            while time.monotonic() < start_at:
                time.sleep(0.001)
            c0, t0 = time.process_time(), time.monotonic()
            per_image = []
            for part in images:
                t = time.perf_counter()
                stage.encode([part])
                per_image.append(time.perf_counter() - t)
            t1, c1 = time.monotonic(), time.process_time()
            affinity = sorted(os.sched_getaffinity(0))
            results.put(("done", core, {"start": t0, "end": t1, "cpu_s": c1 - c0, "images": len(images),
                                        "median_encode_s": statistics.median(per_image), "affinity": affinity}))  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        results.put(("error", core, repr(exc)))


def encoder_report(model_dir: Path, n_images: int, rounds: int, seed: int) -> dict[str, Any]:
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"two encoder instances need two cores; this process may use {cores}")
    cores = cores[:2]
    sets = _image_sets(n_images, seed)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in cores]
    procs = [
        ctx.Process(
            target=_encoder_worker, args=(str(model_dir), core, sets[i], commands[i], results), daemon=True
        )
        for i, core in enumerate(cores)
    ]
    for p in procs:
        p.start()
    try:
        rows = _run_rounds(cores, rounds, commands, results)
    finally:
        for q in commands:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return _summary(cores, n_images, sets, rows)


def _image_sets(n_images: int, seed: int) -> list[list[tuple[int, bytes, int, int]]]:
    """Each instance's ``n_images`` distinct PNGs (sizes cycling over ``SIZES``), preprocessed."""
    sets = []
    t0 = time.perf_counter()
    for inst in range(2):
        sets.append(
            [
                preprocess(png(seed * 100_000 + inst * 10_000 + i, *SIZES[i % len(SIZES)]))
                for i in range(n_images)
            ]
        )
    progress(f"vision: {2 * n_images} images generated and preprocessed in {time.perf_counter() - t0:.1f} s")
    return sets


def _collect(results: Any, n: int, kind: str) -> list[tuple[int, Any]]:
    """``n`` answers of ``kind`` from the instances; an instance's error raises here."""
    got: list[tuple[int, Any]] = []
    while len(got) < n:
        what, core, payload = results.get(timeout=600)
        if what == "error":
            raise RuntimeError(f"encoder instance on core {core} failed: {payload}")
        if what != kind:
            raise RuntimeError(f"unexpected {what!r} from core {core}")
        got.append((core, payload))
    return got


def _run_rounds(cores: list[int], rounds: int, commands: list[Any], results: Any) -> list[dict[str, Any]]:
    """Waits for the instances, then ``rounds`` rounds of one and of two instances,
    interleaved 1, 2, 2, 1, ...; one row per round."""
    rows: list[dict[str, Any]] = []
    _collect(results, len(commands), "ready")
    progress(f"vision: encoder instances ready on cores {cores}")
    order = [k for r in range(rounds) for k in ((1, 2) if r % 2 == 0 else (2, 1))]
    for i, k in enumerate(order):
        start_at = time.monotonic() + 0.2
        for q in commands[:k]:
            q.put(("run", start_at))
        row = _round_row(i, k, sorted(_collect(results, k, "done")))
        rows.append(row)
        cpu = ", ".join(f"{p['cpu_over_wall']:.2f}" for p in row["per_instance"])
        progress(f"vision: round {i}: {k} instance(s) {row['images_per_s']:.2f} images/s (CPU/wall {cpu})")
    return rows


def _round_row(i: int, k: int, done: list[tuple[int, Any]]) -> dict[str, Any]:
    """Round ``i`` of ``k`` instances from their ``(core, payload)`` answers: images / wall
    time from the first start to the last end, and each instance's own figures."""
    wall = max(d["end"] for _, d in done) - min(d["start"] for _, d in done)
    total = sum(d["images"] for _, d in done)
    return {
        "round": i, "instances": k, "images": total, "wall_s": wall, "images_per_s": total / wall,
        "per_instance": [{"core": c, "images_per_s": d["images"] / (d["end"] - d["start"]),
                          "wall_s": d["end"] - d["start"], "cpu_s": d["cpu_s"],
                          "cpu_over_wall": d["cpu_s"] / (d["end"] - d["start"]),
                          "images_per_cpu_s": d["images"] / d["cpu_s"],
                          "median_encode_s": d["median_encode_s"], "affinity": d["affinity"]} for c, d in done],
    }  # fmt: skip


def _summary(
    cores: list[int], n_images: int, sets: list[list[tuple[int, bytes, int, int]]], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """Part 1's results: the rounds and their medians."""
    one = [r["images_per_s"] for r in rows if r["instances"] == 1]
    two = [r["images_per_s"] for r in rows if r["instances"] == 2]
    tokens = [n for s in sets for n, *_ in s]
    return {
        "cores": cores,
        "image_sizes": [f"{w}x{h}" for w, h in SIZES],
        "images_per_instance": n_images,
        "mean_image_tokens": statistics.mean(tokens),
        "rounds": rows,
        "one_instance_images_per_s": statistics.median(one),
        "two_instances_images_per_s": statistics.median(two),
        "scaling": statistics.median(two) / statistics.median(one),
        # per instance, images per second of its own CPU time: what a whole core would give it
        "one_images_per_cpu_s": statistics.median(_per_instance(rows, 1, "images_per_cpu_s")),
        "two_images_per_cpu_s": statistics.median(_per_instance(rows, 2, "images_per_cpu_s")),
        "cpu_normalised_scaling": 2 * statistics.median(_per_instance(rows, 2, "images_per_cpu_s"))
        / statistics.median(_per_instance(rows, 1, "images_per_cpu_s")),
        "one_cpu_over_wall": statistics.median(_per_instance(rows, 1, "cpu_over_wall")),
        "two_cpu_over_wall": statistics.median(_per_instance(rows, 2, "cpu_over_wall")),
    }  # fmt: skip


def _per_instance(rows: list[dict[str, Any]], instances: int, field: str) -> list[float]:
    return [p[field] for r in rows if r["instances"] == instances for p in r["per_instance"]]
