"""Whether the confidence head ranks drafts better on the MTP pass's hidden state before its
final norm, and how its ranking grows with training drafts and L2.

The head the issue specifies is ``sigmoid(w . [h ; e] + b)``; ``h`` is the MTP pass's final
hidden state. The shipped head reads it after the pass's norm (`mtp.norm(mtp.hc_head(x))`,
what ``lm_head`` turns into the draft's logits: `engine.train.confidence.mtp_passes`); the
norm divides out the state's scale, which might carry the pass's certainty. Three heads are
fitted (``fit_head``, the shipped settings) on ``--prompts`` training prefixes' drafts:
``h`` after the norm (shipped), before it, and both (not the issue's form: a bound), then
the after-norm head at L2 0 / 1e-3 / 1e-2 / 1e-1 and 10 / 30 epochs. Each is scored on 256
held-out prefixes, every draft scored: AUC over the drafts reached, and the share of fixed-5's
accepted length kept when 75 % of its drafts are verified by survival (the c >= 32 target's
point; ``scripts/confidence_inputs.py``'s measure).

    .venv/bin/python scripts/confidence_prenorm.py --prompts 2048

About 10 minutes at 2,048 prompts on the 2-core VM. Needs ``sluice train data --out var/train-data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import confidence_inputs as inputs  # this folder: run as a script
import numpy as np
import torch
from confidence_inputs import every_draft, fixed5_rows, kept_at_target, reached_of

import engine.train.confidence as confidence
from engine.model.confidence import softmax_features
from engine.train.calibration import auc
from engine.train.model import load_trained
from engine.train.settings import ConfidenceSettings
from engine.train.trainer import Streams


def passes_both(model, chain: torch.Tensor, prompt_len: int, depth: int, trunk=None):
    """`mtp_passes` with ``h`` = [before the norm ; after it] ([P, A, 2D])."""
    m = model.mtp
    embed = model.lm.model.embed_tokens
    streams, kwargs = model.trunk(chain) if trunk is None else trunk
    nxt = torch.cat([chain[:, 1:], chain[:, -1:]], dim=1)
    t = confidence.anchors(chain, prompt_len, depth)
    for j, hidden in enumerate(model.draft_passes(streams, nxt, kwargs, depth), start=1):
        q = t + j - 1
        pre = m.hc_head(hidden[:, q])
        h = m.norm(pre).float()
        logits = model.lm.lm_head(h.to(model.lm.lm_head.weight.dtype)).float()
        yield confidence.DraftPass(
            j,
            torch.cat([pre.float(), h], -1),
            embed(nxt[:, q]).float(),
            softmax_features(logits),
            logits.argmax(dim=-1) == chain[:, t + j + 1],
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/trained")
    p.add_argument("--data", default="var/train-data")
    p.add_argument("--prompts", type=int, default=1024, help="training prefixes")
    args = p.parse_args()
    t0 = time.monotonic()
    s = ConfidenceSettings(prompts=args.prompts, eval_prompts=256)
    model_dir = Path(args.model)
    data = Streams(Path(args.data))
    model = load_trained(model_dir, "cpu")
    # draft_examples and every_draft look the passes up in their modules at each call
    confidence.mtp_passes = inputs.mtp_passes = passes_both

    def chains_of(stream: np.ndarray, n: int) -> torch.Tensor:
        rows = confidence.prompt_rows(stream, n, s.prompt_len, data.bos)
        return confidence.make_chains(rows, s.gen_tokens, s.chains, model, model_dir, "cpu", s.micro_batch)

    train = confidence.draft_examples(
        model, chains_of(data.train, s.prompts), s.prompt_len, s.depth, s.micro_batch
    )
    print(f"[{time.monotonic() - t0:5.0f}s] train: {len(train.label)} drafts reached", flush=True)
    h, e, _, ok = every_draft(model, chains_of(data.heldout, s.eval_prompts), s)
    anchors, depth = ok.shape
    width = h.shape[-1] // 2
    reached, rows = reached_of(ok), fixed5_rows(ok)
    labels = ok[reached].astype(np.float32)
    hf, ef = h.flatten(0, 1), e.flatten(0, 1)

    def score(name: str, x_train: torch.Tensor, x_held: torch.Tensor, settings: ConfidenceSettings) -> None:
        head, _ = confidence.fit_head(x_train, train.label, settings)
        w, b = head.confidence.weight[0].detach().double(), head.confidence.bias.detach().double()
        conf = torch.sigmoid(x_held.double() @ w + b).view(anchors, depth).numpy()
        kept = kept_at_target(conf, rows)
        print(
            f"{name}: AUC {auc(conf[reached], labels):.4f}, kept at 0.75 verified {kept:.4f}",
            flush=True,
        )

    post = (torch.cat([train.h[:, width:], train.e], 1), torch.cat([hf[:, width:], ef], 1))
    score("[h after the norm ; e] (shipped)", *post, s)
    score(
        "[h before the norm ; e]",
        torch.cat([train.h[:, :width], train.e], 1),
        torch.cat([hf[:, :width], ef], 1),
        s,
    )
    score("[both ; e] (not the issue's form)", torch.cat([train.h, train.e], 1), torch.cat([hf, ef], 1), s)
    for wd in (0.0, 1e-3, 1e-2, 1e-1):
        for epochs in (10, 30):
            score(
                f"after the norm, L2 {wd}, {epochs} epochs",
                *post,
                dataclasses.replace(s, weight_decay=wd, epochs=epochs),
            )
    print(f"[{time.monotonic() - t0:5.0f}s] done", flush=True)


if __name__ == "__main__":
    main()
