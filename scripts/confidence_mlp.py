"""Does a hidden layer help the confidence head rank drafts? (It does not, on these drafts.)

The shipped head is logistic on ``[h ; e ; softmax ; position]`` (docs/training.md,
"Confidence head"). This fits it as ``scripts/confidence_context.py`` does (its ``base``
inputs, the shipped settings) beside small MLPs on the same inputs (standardised; one GELU
hidden layer; AdamW; 10 % of the training drafts held back to stop on their loss), and scores
each as the other scripts do: held-out AUC over the drafts reached, the accepted length kept
at 75 % of fixed-5's drafts verified, and the trade-off at DeepSeek's implied survival
threshold 0.148.

    .venv/bin/python scripts/confidence_mlp.py [--prompts 2048] [--cache FILE]

About 11 min at 2048 training prefixes on the 2-core VM, most of it collecting the drafts
(``--cache`` keeps them for a rerun). Needs the training data (``sluice train data --out
var/train-data``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from confidence_context import collect_sets, features  # this folder: run as a script
from confidence_inputs import fit_weights, fixed5_rows, kept_at_target, reached_of, threshold_shares

from engine.train.calibration import auc
from engine.train.settings import ConfidenceSettings

# (hidden width, weight decay, dropout): from a small, lightly regularised layer to a wide one
MLPS = ((32, 1e-4, 0.0), (64, 1e-4, 0.1), (128, 1e-3, 0.2), (256, 1e-3, 0.3))


def fit_mlp(
    x: torch.Tensor, y: torch.Tensor, hidden: int, wd: float, drop: float
) -> tuple[nn.Module, int, float]:
    """An MLP head on standardised ``x``, stopped after 5 epochs without a better loss on the
    held-back tenth (at most 60); returns it with its epochs and that loss."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    held, kept = perm[: len(x) // 10], perm[len(x) // 10 :]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Dropout(drop), nn.Linear(x.shape[1], hidden), nn.GELU(), nn.Dropout(drop), nn.Linear(hidden, 1)
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=wd)
    best, state, bad, epochs = float("inf"), None, 0, 0
    for _ in range(60):
        epochs += 1
        net.train()
        for idx in kept[torch.randperm(len(kept))].split(512):
            loss = F.binary_cross_entropy_with_logits(net(x[idx])[:, 0], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            val = F.binary_cross_entropy_with_logits(net(x[held])[:, 0], y[held]).item()
        if val < best - 1e-5:
            best, state, bad = val, {k: v.clone() for k, v in net.state_dict().items()}, 0
        else:
            bad += 1
            if bad >= 5:
                break
    assert state is not None
    net.load_state_dict(state)
    return net.eval(), epochs, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/trained")
    p.add_argument("--data", default="var/train-data")
    p.add_argument("--prompts", type=int, default=2048, help="training prefixes")
    p.add_argument("--cache", type=Path, help="keep the collected drafts here (torch.save), and reuse them")
    args = p.parse_args()
    t0 = time.monotonic()
    torch.set_num_threads(2)
    s = ConfidenceSettings(prompts=args.prompts, eval_prompts=256)
    if args.cache is not None and args.cache.is_file():
        sets = torch.load(args.cache, weights_only=False)
    else:
        sets = collect_sets(Path(args.model), Path(args.data), s, t0)
        if args.cache is not None:
            torch.save(sets, args.cache)
    print(f"[{time.monotonic() - t0:5.0f}s] drafts collected", flush=True)
    train, held, depth = sets["train"], sets["held"], s.depth
    r_train, r_held = reached_of(train[4]), reached_of(held[4])
    anchors, rows = len(held[4]), fixed5_rows(held[4])
    labels = held[4][r_held].astype(np.float32)
    x = features(*train, "base", depth)[torch.from_numpy(r_train)]
    y = torch.from_numpy(train[4][r_train].astype(np.float32))
    x_held = features(*held, "base", depth).flatten(0, 1)

    def report(name: str, conf: np.ndarray) -> None:
        v, a = threshold_shares(conf, rows, 0.148)
        print(
            f"{name}: auc {auc(conf[r_held], labels):.4f}, kept at 0.75 verified "
            f"{kept_at_target(conf, rows, points=361):.4f}, survival > 0.148: verified {v:.3f} kept {a:.4f} "
            f"[{time.monotonic() - t0:.0f}s]",
            flush=True,
        )

    w, b = fit_weights(x, y.numpy(), s, None)
    report(
        "logistic (the shipped form)", torch.sigmoid((x_held.double() @ w + b).view(anchors, depth)).numpy()
    )
    mu, sd = x.mean(0), x.std(0) + 1e-6
    for hidden, wd, drop in MLPS:
        net, epochs, val = fit_mlp((x - mu) / sd, y, hidden, wd, drop)
        with torch.no_grad():
            conf = torch.sigmoid(net((x_held - mu) / sd)[:, 0]).view(anchors, depth).double().numpy()
        report(
            f"mlp {hidden} wide, weight decay {wd}, dropout {drop} ({epochs} epochs, loss {val:.4f})", conf
        )


if __name__ == "__main__":
    main()
