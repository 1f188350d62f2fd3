"""What the confidence head's inputs can tell: held-out AUC and the selection's trade-off of
the ``[h ; e]`` head against the same head with the drafter's own softmax added.

Two logistic heads are fitted (``engine.train.confidence.fit_head``, the shipped settings) on
the trained preset's drafts over the training split:

* ``[h; e]``: ``sigmoid(w . [h ; e] + b)`` (``h`` the MTP pass's output, ``e`` the
  embedding of the token it was fed);
* ``[h; e; softmax; position]``: the same plus the pass's own softmax over the vocabulary
  (log of its top probability, log-ratio of the top two, entropy) and the draft's position
  (one-hot), all computable where the drafter already takes its argmax (the shipped form);
* the same without the entropy, and with the log-ratio alone (which needs no ``exp`` over
  the vocabulary).

Each is scored on held-out-v1 anchors with every draft (reached or not): the AUC over the
reached drafts (what ``confidence.json`` reports), and DSpark's survival-threshold
trade-off (``services.bench._spec_replay``'s): the share of fixed-5's drafts verified and of
its accepted length kept, at 75 % verified (the c >= 32 target's point) and at the thresholds
DeepSeek's published costs imply (``scripts/dspark_threshold.py``: 0.148, 0.178, 0.444).
The softmax features alone are also scored (AUC, no fit).

    .venv/bin/python scripts/confidence_inputs.py [--prompts 512] [--eval-prompts 256]

About 10 minutes on the 2-core VM at the defaults (the greedy chains and the drafting passes).
Needs the training data (``sluice train data --out var/train-data``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.confidence import ConfidenceConfig
from engine.train.calibration import auc
from engine.train.confidence import draft_examples, fit_head, make_chains, mtp_passes, prompt_rows
from engine.train.model import load_trained
from engine.train.settings import ConfidenceSettings
from engine.train.trainer import Streams
from services.bench._spec_replay import TARGET_VERIFIED_SHARE, shares

THRESHOLDS = (0.07, 0.148, 0.178, 0.444)


def one_hot(position: np.ndarray, depth: int) -> torch.Tensor:
    return F.one_hot(torch.as_tensor(position - 1), depth).float()


@torch.no_grad()
def every_draft(model, chains: torch.Tensor, s: ConfidenceSettings):
    """Per anchor, every draft (reached or not): h, e [A, depth, D], the draft distribution's
    `softmax_features` [A, depth, 3] and accepted [A, depth] (draft j equals the target's
    greedy token), from ``mtp_passes``."""
    model.eval()
    model.indexer.enabled = False
    parts: tuple[list, list, list, list] = ([], [], [], [])
    for i in range(0, len(chains), s.micro_batch):
        passes = list(mtp_passes(model, chains[i : i + s.micro_batch], s.prompt_len, s.depth))
        for out, field in zip(parts, ("h", "e", "soft", "agree")):
            out.append(torch.stack([getattr(p, field) for p in passes], 2).flatten(0, 1))
    model.indexer.enabled = True
    h, e, soft, ok = (torch.cat(out) for out in parts)
    return h, e, soft, ok.numpy()


def fit_weights(
    x: torch.Tensor, y: np.ndarray, s: ConfidenceSettings, cfg: ConfidenceConfig | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [width], b) of ``fit_head`` on ``x``: a head of ``cfg``, or (None) a logistic fit on
    any width (padded to the even width the ``[h ; e]`` form takes by a zero column, whose
    weight stays 0)."""
    width = x.shape[1]
    if cfg is None and width % 2:
        x = torch.cat([x, torch.zeros(len(x), 1)], 1)
    head, _ = fit_head(x, y, s, cfg=cfg)
    w = torch.cat([head.confidence.weight[0], head.position_bias]).detach().double()
    return w[:width], head.confidence.bias.detach().double()


def threshold_shares(conf: np.ndarray, rows: list, threshold: float) -> tuple[float, float]:
    """(verified share, accepted-length share) of fixed-5's when each anchor verifies the
    drafts whose survival exceeds ``threshold`` (the bench's replay, ``_spec_replay.shares``,
    over ``rows``: each anchor's (drafts, accepted drafts))."""
    out = shares(rows, (np.cumprod(conf, axis=1) > threshold).sum(1).tolist())
    return out["verified_share"], out["accepted_length_share"]


def reached_of(ok: np.ndarray) -> np.ndarray:
    """[A, depth] bool: draft j of an anchor is reached when every earlier one was accepted."""
    return np.concatenate([np.ones((len(ok), 1), bool), np.cumprod(ok, 1)[:, :-1].astype(bool)], 1)


def fixed5_rows(ok: np.ndarray) -> list:
    """Each anchor's row for `threshold_shares` (``shares`` reads the accepted count only)."""
    return [((0.0,) * ok.shape[1], int(n)) for n in np.cumprod(ok, axis=1).sum(1)]


def kept_at_target(conf: np.ndarray, rows: list, points: int = 181) -> float:
    """The share of fixed-5's accepted length kept at ``TARGET_VERIFIED_SHARE`` of its drafts
    verified: the survival-threshold curve over ``points`` thresholds in [0, 0.9], interpolated."""
    curve = sorted(threshold_shares(conf, rows, t) for t in np.linspace(0.0, 0.9, points))
    return float(np.interp(TARGET_VERIFIED_SHARE, [c[0] for c in curve], [c[1] for c in curve]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/trained")
    p.add_argument("--data", default="var/train-data")
    p.add_argument("--prompts", type=int, default=512, help="training prefixes")
    p.add_argument("--eval-prompts", type=int, default=256, help="held-out prefixes")
    args = p.parse_args()
    t0 = time.monotonic()
    s = ConfidenceSettings(prompts=args.prompts, eval_prompts=args.eval_prompts)
    model_dir = Path(args.model)
    data = Streams(Path(args.data))
    model = load_trained(model_dir, "cpu")

    def chains_of(stream: np.ndarray, n: int) -> torch.Tensor:
        rows = prompt_rows(stream, n, s.prompt_len, data.bos)
        return make_chains(rows, s.gen_tokens, s.chains, model, model_dir, "cpu", s.micro_batch)

    train = draft_examples(model, chains_of(data.train, s.prompts), s.prompt_len, s.depth, s.micro_batch)
    print(f"[{time.monotonic() - t0:5.0f}s] train: {len(train.label)} drafts reached", flush=True)
    h, e, soft, ok = every_draft(model, chains_of(data.heldout, s.eval_prompts), s)
    anchors, depth = ok.shape
    rows, reached = fixed5_rows(ok), reached_of(ok)
    print(f"[{time.monotonic() - t0:5.0f}s] held out: {anchors} anchors", flush=True)

    hf, ef = h.flatten(0, 1), e.flatten(0, 1)
    soft_held = soft.flatten(0, 1)
    position = np.tile(np.arange(1, depth + 1), anchors)
    rich = ConfidenceConfig(hf.shape[1], softmax=True, positions=depth)
    pos_train, pos_held = one_hot(train.position, depth), one_hot(position, depth)
    inputs = {
        "[h; e]": (train.x, torch.cat([hf, ef], 1), None),
        "[h; e; softmax; position]": (
            train.inputs(rich),
            torch.cat([hf, ef, soft_held, pos_held], 1),
            rich,
        ),
    }
    for name, cols in (("log_p_max, log_margin", [0, 1]), ("log_margin", [1])):  # without the entropy
        inputs[f"[h; e; {name}; position]"] = (
            torch.cat([train.x, train.soft[:, cols], pos_train], 1),
            torch.cat([hf, ef, soft_held[:, cols], pos_held], 1),
            None,
        )
    report: dict[str, dict] = {"softmax features alone (AUC)": {}}
    labels = ok[reached].astype(np.float32)
    for i, name in enumerate(("log_p_max", "log_margin", "entropy")):
        score = soft_held[:, i].double().numpy().reshape(anchors, depth) * (-1 if name == "entropy" else 1)
        report["softmax features alone (AUC)"][name] = auc(score[reached], labels)
    for name, (x_train, x_held, cfg) in inputs.items():
        w, b = fit_weights(x_train, train.label, s, cfg)
        conf = torch.sigmoid(x_held.double() @ w + b).view(anchors, depth).numpy()
        row = {
            "auc": auc(conf[reached], labels),
            f"accepted_length_share_at_{TARGET_VERIFIED_SHARE}_verified": kept_at_target(conf, rows),
        }
        for t in THRESHOLDS:
            v, a = threshold_shares(conf, rows, t)
            row[f"threshold_{t}"] = {"verified_share": round(v, 3), "accepted_length_share": round(a, 4)}
        report[name] = row
    print(json.dumps(report, indent=1))
    print(f"[{time.monotonic() - t0:5.0f}s] done", flush=True)


if __name__ == "__main__":
    main()
