"""Does the confidence head rank drafts better with context it does not read today?

The shipped head reads ``[h ; e ; softmax ; position]`` (docs/training.md, "Confidence
head"). This fits the same logistic head (``engine.train.confidence.fit_head``, the shipped
settings) with more inputs, all available where the drafter runs:

* ``tgt``: the target's own softmax numbers (``softmax_features``) at the anchor, the
  position whose token the first draft follows: how sure the model was there;
* ``prev``: the previous draft's softmax numbers (the target's, for the first draft);
* ``cum``: the sum of the log top probabilities of the drafts so far;
* ``/perpos``: a separate head per draft position instead of one with a position bias.

Each is scored as ``scripts/confidence_inputs.py`` scores heads: held-out AUC over the drafts
reached, the accepted length kept at 75 % of fixed-5's drafts verified, and the trade-off at
DeepSeek's implied survival thresholds 0.148 and 0.178.

    .venv/bin/python scripts/confidence_context.py [--prompts 512] [--variants base,tgt,...]

About 3 min at 512 training prefixes on the 2-core VM, 8 min at 2048. Needs the training
data (``sluice train data --out var/train-data``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from confidence_inputs import (  # this folder: run as a script
    fit_weights,
    fixed5_rows,
    kept_at_target,
    reached_of,
    threshold_shares,
)

from engine.model.confidence import softmax_features
from engine.train.calibration import auc
from engine.train.confidence import anchors, make_chains, mtp_passes, prompt_rows
from engine.train.model import load_trained
from engine.train.settings import ConfidenceSettings
from engine.train.trainer import Streams
from services.bench._spec_replay import TARGET_VERIFIED_SHARE

VARIANTS = ("base", "tgt", "prev", "tgt+prev", "tgt+prev+cum", "base/perpos", "tgt+prev/perpos")


@torch.no_grad()
def collect(model, chains: torch.Tensor, s: ConfidenceSettings):
    """Every draft (reached or not) at every anchor: h, e [A, depth, D], the drafts' softmax
    numbers [A, depth, 3], the target's at the anchor [A, 3], and accepted [A, depth]."""
    model.eval()
    model.indexer.enabled = False
    hs, es, soft, target, ok = [], [], [], [], []
    for i in range(0, len(chains), s.micro_batch):
        chain = chains[i : i + s.micro_batch]
        trunk = model.trunk(chain)
        t = anchors(chain, s.prompt_len, s.depth)
        target.append(softmax_features(model.main_logits(trunk[0][:, t]).float()).flatten(0, 1))
        passes = list(mtp_passes(model, chain, s.prompt_len, s.depth, trunk))
        for out, field in zip((hs, es, soft, ok), ("h", "e", "soft", "agree")):
            out.append(torch.stack([getattr(p, field) for p in passes], 2).flatten(0, 1))
    model.indexer.enabled = True
    return torch.cat(hs), torch.cat(es), torch.cat(soft), torch.cat(target), torch.cat(ok).numpy()


def features(h, e, soft, target, ok, kind: str, depth: int) -> torch.Tensor:
    """[A, depth, width]: the head's inputs for ``kind`` (``VARIANTS`` without ``/perpos``)."""
    anchors = len(ok)
    parts = [h, e, soft]
    if "tgt" in kind:
        parts.append(target.unsqueeze(1).expand(anchors, depth, 3))
    if "prev" in kind:
        parts.append(torch.cat([target.unsqueeze(1), soft[:, :-1]], 1))
    if "cum" in kind:
        parts.append(torch.cumsum(soft[:, :, :1], 1))
    parts.append(F.one_hot(torch.arange(depth), depth).float().expand(anchors, depth, depth))
    return torch.cat(parts, 2)


def collect_sets(model_dir: Path, data_dir: Path, s: ConfidenceSettings, t0: float) -> dict:
    """`collect` on ``s.prompts`` training prefixes (``train``) and ``s.eval_prompts`` held-out
    ones (``held``) of the data at ``data_dir``, drafted by the checkpoint at ``model_dir``."""
    data = Streams(data_dir)
    model = load_trained(model_dir, "cpu")

    def chains_of(stream: np.ndarray, n: int) -> torch.Tensor:
        rows = prompt_rows(stream, n, s.prompt_len, data.bos)
        return make_chains(rows, s.gen_tokens, s.chains, model, model_dir, "cpu", s.micro_batch)

    sets = {}
    for name, stream, n in (("train", data.train, s.prompts), ("held", data.heldout, s.eval_prompts)):
        sets[name] = collect(model, chains_of(stream, n), s)
        print(f"[{time.monotonic() - t0:5.0f}s] {name}: {sets[name][4].shape}", flush=True)
    return sets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/trained")
    p.add_argument("--data", default="var/train-data")
    p.add_argument("--prompts", type=int, default=512, help="training prefixes")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    t0 = time.monotonic()
    s = ConfidenceSettings(prompts=args.prompts, eval_prompts=256)
    sets = collect_sets(Path(args.model), Path(args.data), s, t0)
    train, held, depth = sets["train"], sets["held"], s.depth
    r_train, r_held = reached_of(train[4]), reached_of(held[4])
    anchors = len(held[4])
    rows = fixed5_rows(held[4])
    labels = held[4][r_held].astype(np.float32)
    for kind in args.variants.split(","):
        inputs = kind.split("/")[0]
        x_train, x_held = features(*train, inputs, depth), features(*held, inputs, depth)
        if kind.endswith("/perpos"):
            logit = torch.zeros(anchors, depth, dtype=torch.float64)
            for j in range(depth):
                m = r_train[:, j]
                w, b = fit_weights(
                    x_train[:, j][torch.from_numpy(m)], train[4][:, j][m].astype(np.float32), s, None
                )
                logit[:, j] = x_held[:, j].double() @ w + b
        else:
            w, b = fit_weights(
                x_train[torch.from_numpy(r_train)], train[4][r_train].astype(np.float32), s, None
            )
            logit = (x_held.flatten(0, 1).double() @ w + b).view(anchors, depth)
        conf = torch.sigmoid(logit).numpy()
        row = {
            "auc": round(auc(conf[r_held], labels), 4),
            f"acc_share_at_{TARGET_VERIFIED_SHARE}": round(kept_at_target(conf, rows, points=361), 4),
        }
        for t in (0.148, 0.178):
            v, a = threshold_shares(conf, rows, t)
            row[f"t{t}"] = (round(v, 3), round(a, 4))
        print(kind, row, flush=True)
    print(f"[{time.monotonic() - t0:5.0f}s] done")


if __name__ == "__main__":
    main()
