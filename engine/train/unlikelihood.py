"""``sluice train unlikelihood``: a short stage after ``sluice train model`` against greedy loops.

The model stage's checkpoint decodes greedily into repetition loops ("list of the list of
...", ``method, method, method``) that keep most held-out function headers from parsing.
This stage continues training that checkpoint for a few steps with the same objective
plus token-level unlikelihood (``engine.train.model.unlikelihood``; Welleck et al., 2019):
at every position, the tokens of the last ``window`` positions other than the target lose
probability. ``window`` is the sliding-window attention's 128 tokens, the span every layer
reads exactly. ``alpha``, ``steps`` and ``lr`` are the values of the sweep in
docs/training.md, which also gives what each other value measured.

It is a pure function of (base checkpoint, data directory, settings, device kind): the base's
stored weights (widened to fp32) start it, a fresh AdamW follows the settings' schedule (a
linear warm-up to a constant ``lr``, the model stage's final rate), and the batches are the
model stage's first ``steps`` batches for the same seed. It writes a checkpoint in the model
stage's layout; ``training.json`` keeps the base's record under ``base`` and adds this
stage's settings, timings and held-out measures, and ``curve_unlikelihood.jsonl`` its steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from engine.train.settings import UnlikelihoodSettings
from engine.train.trainer import (
    PRESET_NAME,
    Log,
    TrainSettings,
    _eval_batch,
    _measure,
    _param_groups,
    batches,
    continue_checkpoint,
    write_checkpoint,
)

CURVE_NAME = "curve_unlikelihood.jsonl"


def train_unlikelihood(
    model_dir: Path | str,
    data_dir: Path | str,
    out_dir: Path | str,
    settings: UnlikelihoodSettings | None = None,
    device: str = "cpu",
    log: Log | None = None,
) -> dict[str, Any]:
    """Continue ``model_dir``'s checkpoint with the unlikelihood term; write ``out_dir``;
    return its ``training.json``."""
    from engine.train.model import load_trained

    s = settings if settings is not None else UnlikelihoodSettings()
    s.validate()
    log = log if log is not None else Log()
    start = continue_checkpoint(model_dir, data_dir, out_dir, device)
    model_dir, out_dir, data, dev = start.model_dir, start.out_dir, start.data, start.device
    torch.manual_seed(s.seed)
    model = load_trained(model_dir, dev)
    model.train()
    opt = torch.optim.AdamW(_param_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"unlikelihood stage on {model_dir} (model.safetensors {start.base_sha[:12]}): alpha {s.alpha}, "
        f"window {s.window}, {s.steps} steps of {s.batch} x {s.seq_len} tokens at lr {s.lr:g}, on {dev}"
    )
    order = TrainSettings(
        seed=s.seed, seq_len=s.seq_len, batch=s.batch, micro_batch=s.micro_batch, steps=s.steps
    )
    n_micro = s.batch // s.micro_batch
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    with (out_dir / CURVE_NAME).open("w") as curve:
        for step, (y_np, epoch) in enumerate(batches(data.train, order)):
            if step >= s.steps:
                break
            lr = s.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            sums = {"lm": 0.0, "mtp": 0.0, "indexer": 0.0, "ul": 0.0}
            for m in range(n_micro):
                y = torch.from_numpy(y_np[m * s.micro_batch : (m + 1) * s.micro_batch]).to(dev)
                x = torch.cat([torch.full_like(y[:, :1], data.bos), y[:, :-1]], dim=1)
                losses = model(x, y, ul_window=s.window)
                loss = (
                    losses["lm"] + s.mtp_weight * losses["mtp"] + losses["indexer"] + s.alpha * losses["ul"]
                )
                (loss / n_micro).backward()
                for k in sums:
                    sums[k] += float(losses[k].detach()) / n_micro
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            max_load = model.balancer.update()
            done = step + 1
            last = {"step": done, "epoch": epoch, "lr": lr, **sums, "grad_norm": grad_norm,
                    "max_load": max_load, "elapsed_s": time.monotonic() - t0}  # fmt: skip
            curve.write(json.dumps(last) + "\n")
            if done == 1 or done % 10 == 0 or done == s.steps:
                log(
                    f"step {done}/{s.steps} loss {sums['lm']:.4f} unlikelihood {sums['ul']:.4f} "
                    f"mtp {sums['mtp']:.4f} lr {lr:.2e} max/mean expert load {max_load:.2f}"
                )
    train_s = time.monotonic() - t0
    model.eval()
    log(f"trained {s.steps} steps in {train_s:.0f} s; scoring heldout-v1")
    measures = _measure(
        model, data, dev, s.seq_len, _eval_batch(dev, s.seq_len, s.micro_batch), s.accept_prompts, log
    )
    info = {
        "preset": PRESET_NAME,
        "stage": "unlikelihood",
        "settings": dataclasses.asdict(s),
        **start.record(),
        "train_seconds": round(train_s, 1),
        "final_step": last,
        **measures,
    }
    write_checkpoint(model, out_dir, start.data_dir, info)
    if (model_dir / "curve.jsonl").is_file():  # the base's curve, beside this stage's
        shutil.copyfile(model_dir / "curve.jsonl", out_dir / "curve.jsonl")
    log(f"wrote {out_dir}")
    return info
