"""``sluice train drafter``: the MTP layer distilled from its own target, chained as speculation
chains it.

The model stage trains the MTP layer on the data (cross-entropy of the token after next, at
weight 0.3 beside the main loss), and only as pass 1, from the trunk's streams. Speculation
asks something else of it: that its drafts *equal the target's* tokens, and that pass ``j >
1``, which reads pass ``j - 1``'s output instead of the trunk's, still drafts well. This stage
freezes everything the target computes with (trunk, embeddings, ``lm_head``) and trains only
``mtp.0.*`` on both, from the data's windows:

* the target's distribution over the token after next is the label: per pass, the KL
  divergence from the target's softmax at position ``q + 1`` to the pass's draft softmax at
  ``q`` (distillation of the drafter from the target, as DistillSpec, Zhou et al., 2023, and
  Medusa-2's self-distillation train drafters; top-1 agreement is what greedy verification
  accepts, and the soft labels carry the target's whole ranking);
* every one of the ``depth`` chained passes is trained (``TrainModel.draft_passes``) and
  the gradient runs through the chain, as EAGLE-3's "training-time test" trains its drafter
  on its own outputs; the passes weigh equally;
* optionally (``confidence_weight`` > 0) a confidence head of the ``[h ; e]`` form,
  ``sigmoid(Linear([h ; e]))``, trains beside it on each pass's top-1 agreement, its BCE
  added at that weight, so that the gradient teaches ``h`` to carry what the head reads. The
  head does not ship (``sluice train confidence`` fits the one that does, on reached drafts
  alone); it is kept beside the checkpoint as ``JOINT_HEAD``, from which a continuation
  resumes it. It starts from a fitted head or a kept one (``confidence_from``) or at zero,
  where it passes no gradient to ``h`` until its weights have grown, and trains at its own
  stage's learning rate.

The trunk's tensors are written back byte for byte (checked before writing), so the target,
its perplexity and every token it emits are unchanged; only the drafts change. It is a pure
function of (checkpoint, data directory, settings, device kind): the windows are the model
stage's for the same seed and shape. ``training.json`` keeps the input checkpoint's record
under ``base`` and adds this stage's settings, timings and held-out measures;
``curve_drafter.jsonl`` has each step's per-pass KL and top-1 agreement.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.train.model import TrainModel, export_state
from engine.train.settings import DrafterSettings, TrainSettings
from engine.train.trainer import (
    PRESET_NAME,
    Log,
    _eval_batch,
    _measure,
    batches,
    continue_checkpoint,
    write_checkpoint,
)

CURVE_NAME = "curve_drafter.jsonl"
# the head trained beside the drafter (``confidence.weight`` [1, 2D], ``confidence.bias`` [1],
# fp32): not the engine's (``confidence/``), but what a continuation starts its head from
JOINT_HEAD = "confidence_joint.safetensors"


def distillation_losses(
    model: TrainModel, ids: torch.Tensor, depth: int, head: torch.nn.Linear | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """ids [B, S] -> per pass ``j = 1..depth``: the mean KL divergence from the target's
    distribution over the token after next to the pass's draft distribution, over every
    position ``q`` with an anchor (``j - 1 <= q < S - 1``); whether the draft's top-1 there
    equals the target's ([B, S - j] booleans); and with a confidence ``head`` (Linear(2D -> 1)
    on ``[h ; e]``), the mean BCE of its logit against that agreement
    (else no entries)."""
    n = ids.shape[1]
    with torch.no_grad():
        streams, kwargs = model.trunk(ids)
        target = model.main_logits(streams).float().log_softmax(dim=-1)  # at t: the token after t
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    kls: list[torch.Tensor] = []
    agree: list[torch.Tensor] = []
    bces: list[torch.Tensor] = []
    for j, hidden in enumerate(model.draft_passes(streams, nxt, kwargs, depth), start=1):
        # pass j at q drafts the token after q + 1, which the target predicts at row q + 1
        h = model.mtp_hidden(hidden[:, j - 1 : n - 1])
        logp = model.lm.lm_head(h).float().log_softmax(dim=-1)
        tgt = target[:, j:n]
        kls.append((tgt.exp() * (tgt - logp)).sum(dim=-1).mean())
        agree.append(logp.detach().argmax(dim=-1) == tgt.argmax(dim=-1))
        if head is not None:
            e = model.lm.model.embed_tokens(nxt[:, j - 1 : n - 1]).float()  # the token the pass was fed
            logit = head(torch.cat([h.float(), e], dim=-1)).squeeze(-1)
            bces.append(F.binary_cross_entropy_with_logits(logit, agree[-1].float()))
    return kls, agree, bces


def _confidence_start(source: str, width: int) -> torch.nn.Linear:
    """The head trained beside the drafter: ``source``'s fitted head (a checkpoint directory
    with ``confidence/model.safetensors``), a head an earlier run of this stage kept (its
    ``JOINT_HEAD`` file), or zeros when ``source`` is empty."""
    head = torch.nn.Linear(width, 1)
    if not source:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        return head
    state = _joint_head(Path(source)) if source.endswith(".safetensors") else _fitted_head(source)
    if state["weight"].shape != head.weight.shape or state["bias"].shape != head.bias.shape:
        raise ValueError(
            f"confidence_from: {source}'s head reads {state['weight'].shape[-1]} inputs, not {width}"
        )
    head.load_state_dict(state)
    return head


def _fitted_head(source: str) -> dict[str, torch.Tensor]:
    from engine.model.confidence import load_confidence_head

    fitted = load_confidence_head(source)
    if fitted is None:
        raise ValueError(f"confidence_from: {source} has no confidence/model.safetensors")
    if fitted.cfg.inputs != "h,e":
        raise ValueError(
            f"confidence_from: {source}'s head reads {fitted.cfg.inputs}; this stage trains an [h ; e] head"
        )
    return dict(fitted.confidence.state_dict())


def _joint_head(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"confidence_from: no file {path}")
    tensors = load_file(str(path))
    if set(tensors) != {"confidence.weight", "confidence.bias"}:
        raise ValueError(f"confidence_from: {path} holds {sorted(tensors)}, not confidence.weight and .bias")
    return {k.removeprefix("confidence."): v.float() for k, v in tensors.items()}


def _trunk_unchanged(model: TrainModel, base: dict[str, torch.Tensor]) -> None:
    """Every tensor outside ``mtp.*`` of the export equals the input checkpoint's, bit for bit."""
    out = export_state(model)
    changed = [k for k, v in out.items() if not k.startswith("mtp.") and not torch.equal(v, base[k])]
    if changed:
        raise RuntimeError(f"the drafter stage changed target tensors: {changed[:5]}")


def train_drafter(
    model_dir: Path | str,
    data_dir: Path | str,
    out_dir: Path | str,
    settings: DrafterSettings | None = None,
    device: str = "cpu",
    log: Log | None = None,
) -> dict[str, Any]:
    """Distil ``model_dir``'s MTP layer from its target; write the checkpoint to ``out_dir``;
    return its ``training.json``."""
    from safetensors.torch import load_file

    from engine.train.model import load_trained

    s = settings if settings is not None else DrafterSettings()
    s.validate()
    log = log if log is not None else Log()
    start = continue_checkpoint(model_dir, data_dir, out_dir, device)
    model_dir, out_dir, data, dev = start.model_dir, start.out_dir, start.data, start.device
    base_state = load_file(str(model_dir / "model.safetensors"))
    torch.manual_seed(s.seed)
    model = load_trained(model_dir, dev)
    model.indexer.enabled = False  # the trunk does not train: no indexer loss
    for p in model.lm.parameters():
        p.requires_grad_(False)
    model.lm.eval()
    model.mtp.train()
    params = list(model.mtp.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    head: torch.nn.Linear | None = None
    if s.confidence_weight > 0:  # trained beside the drafter, then kept apart (module doc)
        head = _confidence_start(s.confidence_from, 2 * model.hf_cfg.hidden_size).to(dev)
        groups.append(
            {"params": list(head.parameters()), "weight_decay": 0.0, "lr_scale": s.confidence_lr / s.lr}
        )
    opt = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"drafter stage on {model_dir} (model.safetensors {start.base_sha[:12]}): {sum(p.numel() for p in params):,} "
        f"MTP parameters, {s.depth} chained passes, {s.steps} steps of {s.batch} x {s.seq_len} tokens "
        f"at lr {s.lr:g}, on {dev}"
    )
    order = TrainSettings(seed=s.seed, seq_len=s.seq_len, batch=s.batch, micro_batch=s.batch, steps=s.steps)
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    with (out_dir / CURVE_NAME).open("w") as curve:
        for step, (y_np, epoch) in enumerate(batches(data.train, order)):
            lr = s.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            y = torch.from_numpy(y_np).to(dev)
            ids = torch.cat([torch.full_like(y[:, :1], data.bos), y[:, :-1]], dim=1)
            kls, agree, bces = distillation_losses(model, ids, s.depth, head)
            loss = torch.stack(kls).mean()
            if bces:
                loss = loss + s.confidence_weight * torch.stack(bces).mean()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, s.clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            max_load = model.balancer.update()  # the MTP layer's router; the frozen trunk's count nothing
            done = step + 1
            elapsed = time.monotonic() - t0
            last = {"step": done, "epoch": epoch, "lr": lr, "kl": [float(k.detach()) for k in kls],
                    "agree": [float(a.float().mean()) for a in agree], "grad_norm": grad_norm, "max_load": max_load, "elapsed_s": elapsed}  # fmt: skip
            if bces:
                last["bce"] = [float(b.detach()) for b in bces]
            curve.write(json.dumps(last) + "\n")
            if done == 1 or done % 10 == 0 or done == s.steps:
                eta = (s.steps - done) * elapsed / done
                log(
                    f"step {done}/{s.steps} KL per pass " + " ".join(f"{k:.3f}" for k in last["kl"])
                    + " top-1 agreement " + " ".join(f"{a:.3f}" for a in last["agree"])
                    + f" lr {lr:.2e} eta {math.ceil(eta)} s"
                )  # fmt: skip
    train_s = time.monotonic() - t0
    model.eval()
    _trunk_unchanged(model, base_state)
    log(f"trained {s.steps} steps in {train_s:.0f} s; the target's tensors are unchanged; scoring heldout-v1")
    # scored as the base was scored
    seq_len = int(start.base_info.get("settings", {}).get("seq_len", s.seq_len))
    measures = _measure(model, data, dev, seq_len, _eval_batch(dev, seq_len, 1), s.accept_prompts, log)
    info = {
        "preset": PRESET_NAME,
        "stage": "drafter",
        "settings": dataclasses.asdict(s),
        **start.record(),
        "train_seconds": round(train_s, 1),
        "final_step": last,
        **measures,
    }
    if head is not None:
        info["joint_head"] = JOINT_HEAD
    write_checkpoint(model, out_dir, start.data_dir, info)
    if head is not None:  # kept for a continuation (module doc)
        from safetensors.torch import save_file

        state = {
            f"confidence.{k}": v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()
        }
        save_file(state, str(out_dir / JOINT_HEAD))
    for name in ("curve.jsonl", "curve_unlikelihood.jsonl"):  # the earlier stages' curves, beside this one's
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    log(f"wrote {out_dir}")
    return info
