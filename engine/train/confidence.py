"""``sluice train confidence``: fit the draft confidence head (``engine.model.confidence``) on the
trained model's own drafts, and measure its calibration on ``heldout-v1``.

**Drafts.** Exactly as ``engine.train.evaluate.mtp_acceptance`` measures acceptance: from
``prompts`` evenly spaced prefixes of ``prompt_len`` tokens (``[BOS]`` + text) the target
continues greedily for ``gen_tokens`` tokens (the chain ``c``); the MTP layer then drafts
``depth`` tokens per anchor ``t`` in the generated region: pass 1 from the target's streams at
``q = t`` and the embedding of ``c[t+1]``, pass ``j`` from pass ``j-1``'s output streams one
position earlier and the embedding of ``c[t+j]``; draft ``j`` is accepted when it equals
``c[t+j+1]``. The chains come from the engine's greedy decoding (``chains="engine"``, KV-cached,
the target as served) or from ``evaluate.greedy_chains``'s full recomputation
(``chains="recompute"``, ~10x slower on a CPU); the two gave the same tokens on 8 held-out
prompts of the shipped model (32 tokens each) and do on the tests' small model.

**Features and labels.** For draft ``j`` of anchor ``t``: ``h`` = the MTP pass's
``norm(hc_head(streams))`` at ``q`` (the tensor its draft logits are read from) and ``e`` =
``embed_tokens(c[t+j])``, the token the pass was fed (the previous draft; for draft 1 the
target's token); with ``inputs`` naming them, the draft distribution's three
``softmax_features`` and the one-hot of ``j`` follow (`engine.model.confidence`). The label
is 1 when draft ``j`` equals ``c[t+j+1]``. **Only drafts whose
earlier drafts were all accepted are used** (what speculation verifies): after a rejection an
engine stops using the step's drafts, and along the chain the later passes are fed the
target's token rather than the rejected draft, so those drafts are not what an engine would
have drafted; labelling them 0 would teach the head a rejection it cannot see in its inputs.
So ``p_j`` estimates P(draft ``j`` accepted | drafts ``1..j-1`` accepted).

**Text.** Training prompts come from the training split (``source="train"``, the default;
``"valid"`` takes only its ``valid-v1`` files, which the target never trained on, ``"fit"``
only the rest). The target memorised part of the split, but its drafts along its *own* greedy
chains are no easier there: 512 prompts of each gave the same acceptance (0.632 and 0.632;
held-out 0.621), so the whole split is used for its variety. The report's prompts are
``heldout-v1``'s (every fourth of the 256 is one of ``sluice train eval``'s 64).

**Fit.** Logistic regression: BCE plus ``weight_decay`` L2 on the weights, Adam with its
learning rate decaying to 0 on a cosine, ``epochs`` passes over the examples in ``batch``-sized
minibatches in a seeded order; the features are standardised with the training examples' mean
and deviation for the fit and folded back into the head's linear map (and its position biases)
afterwards. It starts from the constant predictor (weights 0, bias the logit of the training
acceptance rate), so the first epoch's loss is measured against that. Deterministic for a seed
(the target's forward runs once, without randomness; the order is seeded).

Output: ``OUT/confidence/model.safetensors`` (``confidence.weight`` [1, 2D] or [1, 2D + 3],
``confidence.bias`` [1], and ``confidence.position`` [depth] for a head reading positions;
fp32) and ``OUT/confidence/confidence.json`` (settings, data and model digests, timings, the
fit's loss per epoch, and the held-out measures: Brier score and log-loss beside the constant
predictors', AUC, reliability bins and expected calibration error, per draft position mean
confidence against observed acceptance).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.confidence import (
    CONFIDENCE_DIR,
    CONFIDENCE_REPORT,
    CONFIDENCE_WEIGHTS,
    ConfidenceConfig,
    ConfidenceHead,
    softmax_features,
)
from engine.train.calibration import brier, calibration, log_loss
from engine.train.data import read_array
from engine.train.evaluate import greedy_chains, prompt_offsets
from engine.train.model import TrainModel
from engine.train.settings import ConfidenceSettings
from engine.train.trainer import Log, Streams, file_sha256, run_environment, training_record


@dataclass
class Examples:
    """Drafts reached (every earlier draft of the anchor accepted), in a fixed order."""

    h: torch.Tensor  # [N, D] fp32
    e: torch.Tensor  # [N, D] fp32
    soft: torch.Tensor  # [N, 3] fp32: the draft distribution's `softmax_features`
    position: np.ndarray  # [N] draft position 1..depth
    label: np.ndarray  # [N] 1.0 accepted / 0.0 rejected
    anchors: int
    unconditional: list[float]  # per position, over every anchor

    @property
    def x(self) -> torch.Tensor:
        """[N, 2D]: the inputs of the ``[h ; e]`` head."""
        return torch.cat([self.h, self.e], dim=1)

    def inputs(self, cfg: ConfidenceConfig) -> torch.Tensor:
        """[N, cfg.width]: what a head of ``cfg`` reads, in its order (position one-hot)."""
        parts = [self.h, self.e] + [self.soft] * cfg.softmax
        if cfg.positions:
            if int(self.position.max()) > cfg.positions:
                raise ValueError(
                    f"drafts at position {int(self.position.max())} > the head's {cfg.positions}"
                )
            pos = torch.as_tensor(self.position - 1)
            parts.append(F.one_hot(pos, cfg.positions).float())
        return torch.cat(parts, dim=1)


def prompt_rows(stream: np.ndarray, n: int, prompt_len: int, bos: int) -> list[list[int]]:
    """``[BOS]`` + ``prompt_len - 1`` tokens at ``evaluate.prompt_offsets``' evenly spaced starts."""
    starts = prompt_offsets(len(stream), n, prompt_len - 1)
    return [[bos, *stream[s : s + prompt_len - 1].astype(np.int64).tolist()] for s in starts]


def make_chains(
    rows: list[list[int]],
    gen_tokens: int,
    how: str,
    model: TrainModel | None = None,
    model_dir: Path | None = None,
    device: str = "cpu",
    micro_batch: int = 16,
) -> torch.Tensor:
    """Greedy continuations ``[P, prompt_len + gen_tokens]`` of equal-length prompts (EOS does not stop them)."""
    if how == "recompute":
        assert model is not None
        dev = next(model.parameters()).device
        out = [
            greedy_chains(model, torch.tensor(rows[i : i + micro_batch], device=dev), gen_tokens).cpu()
            for i in range(0, len(rows), micro_batch)
        ]
        return torch.cat(out)
    from engine import LLM, SamplingParams

    assert model_dir is not None
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, device=device, dtype="float32") as llm:
        outs = llm.generate(prompt_token_ids=rows, sampling_params=params)
    chains = [r + list(o.outputs[0].token_ids) for r, o in zip(rows, outs, strict=True)]
    if any(len(c) != len(rows[0]) + gen_tokens for c in chains):
        raise RuntimeError("the engine returned a chain of the wrong length")
    return torch.tensor(chains)


@torch.no_grad()
def draft_examples(
    model: TrainModel,
    chains: torch.Tensor,
    prompt_len: int,
    depth: int,
    micro_batch: int = 16,
    log: Log | None = None,
    what: str = "drafts",
) -> Examples:
    """The MTP layer's drafts along ``chains`` (``evaluate.mtp_acceptance``'s passes), as head examples."""
    was_training = model.training
    model.eval()
    model.indexer.enabled = False
    dev = next(model.parameters()).device
    hs: list[torch.Tensor] = []
    es: list[torch.Tensor] = []
    soft: list[torch.Tensor] = []
    pos: list[np.ndarray] = []
    lab: list[np.ndarray] = []
    uncond = np.zeros(depth)
    anchors = 0
    last = time.monotonic()
    try:
        for i in range(0, len(chains), micro_batch):
            chain = chains[i : i + micro_batch].to(dev)
            reached: torch.Tensor | None = None
            for p in mtp_passes(model, chain, prompt_len, depth):
                if reached is None:
                    reached = torch.ones_like(p.agree)
                hs.append(p.h[reached].cpu())
                es.append(p.e[reached].cpu())
                soft.append(p.soft[reached].cpu())
                lab.append(p.agree[reached].cpu().numpy().astype(np.float32))
                pos.append(np.full(int(reached.sum()), p.position, dtype=np.int64))
                uncond[p.position - 1] += float(p.agree.sum())
                reached = reached & p.agree
            assert reached is not None
            anchors += reached.numel()
            now = time.monotonic()
            if log is not None and (now - last >= 10 or i + micro_batch >= len(chains)):
                last = now
                log(f"  {what}: {min(i + micro_batch, len(chains))}/{len(chains)} chains")
    finally:
        model.indexer.enabled = True
        model.train(was_training)
    return Examples(
        h=torch.cat(hs),
        e=torch.cat(es),
        soft=torch.cat(soft),
        position=np.concatenate(pos),
        label=np.concatenate(lab),
        anchors=anchors,
        unconditional=[float(u / max(anchors, 1)) for u in uncond],
    )


class DraftPass(NamedTuple):
    """One drafting pass of `mtp_passes` at every anchor of a micro-batch of chains [P, A]."""

    position: int  # the draft's position j, 1-based
    h: torch.Tensor  # [P, A, D] fp32: the pass's output, the head's ``h``
    e: torch.Tensor  # [P, A, D] fp32: the embedding of the token the pass was fed, ``c[t + j]``
    soft: torch.Tensor  # [P, A, 3] fp32: the draft distribution's `softmax_features`
    agree: torch.Tensor  # [P, A] bool: the draft (its argmax) equals the chain's ``c[t + j + 1]``


@torch.no_grad()
def mtp_passes(
    model: TrainModel,
    chain: torch.Tensor,
    prompt_len: int,
    depth: int,
    trunk: tuple[torch.Tensor, dict[str, Any]] | None = None,
) -> Iterator[DraftPass]:
    """The MTP layer's ``depth`` drafting passes along greedy chains ``chain`` [P, n], at every
    anchor ``t`` from the prompt's last position on (while ``t + depth + 1 < n``). Pass ``j``
    is fed ``c[t + j]`` (draft 1: the target's token; a later draft reached with every earlier
    one accepted: the previous draft). ``trunk``: ``model.trunk(chain)`` where the caller has
    it already. Call with the model in eval mode and its indexer off."""
    embed = model.lm.model.embed_tokens
    streams, kwargs = model.trunk(chain) if trunk is None else trunk
    nxt = torch.cat([chain[:, 1:], chain[:, -1:]], dim=1)  # the token after each position
    t = anchors(chain, prompt_len, depth)
    for j, hidden in enumerate(model.draft_passes(streams, nxt, kwargs, depth), start=1):
        q = t + j - 1
        h = model.mtp_hidden(hidden[:, q]).float()  # [P, A, D]
        logits = model.lm.lm_head(h.to(model.lm.lm_head.weight.dtype)).float()
        yield DraftPass(
            j,
            h,
            embed(nxt[:, q]).float(),
            softmax_features(logits),
            logits.argmax(dim=-1) == chain[:, t + j + 1],
        )


def anchors(chain: torch.Tensor, prompt_len: int, depth: int) -> torch.Tensor:
    """The anchors ``t`` of `mtp_passes` along ``chain`` [P, n]: the prompt's last position
    on, while all ``depth`` drafts have a chain token to be checked against (``t + depth + 1 < n``)."""
    return torch.arange(prompt_len - 1, chain.shape[1] - depth - 1, device=chain.device)


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return float(np.log(p / (1 - p)))


def fit_head(
    x: torch.Tensor,
    y: np.ndarray,
    settings: ConfidenceSettings,
    log: Log | None = None,
    cfg: ConfidenceConfig | None = None,
) -> tuple[ConfidenceHead, list[float]]:
    """Logistic regression of ``y`` on ``x`` [N, cfg.width] (no ``cfg``: the ``[h ; e]`` head,
    ``x`` [N, 2D]); -> the head and the mean BCE of each epoch."""
    n, width = x.shape
    cfg = cfg if cfg is not None else ConfidenceConfig(hidden_size=width // 2)
    if width != cfg.width:
        raise ValueError(f"{width} inputs for a head of {cfg.width} ({cfg.inputs})")
    if n == 0:
        raise ValueError("no drafts to fit the confidence head on")
    x = x.double()
    target = torch.from_numpy(y).double()
    mu = x.mean(dim=0)
    sd = x.std(dim=0, unbiased=False).clamp(min=1e-6)
    z = (x - mu) / sd
    w = torch.zeros(width, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(_logit(float(target.mean())), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=settings.lr)
    steps_per_epoch = -(-n // settings.batch)
    total_steps = settings.epochs * steps_per_epoch
    gen = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    step = 0
    for epoch in range(settings.epochs):
        order = torch.randperm(n, generator=gen)
        total = 0.0
        for k in range(0, n, settings.batch):
            idx = order[k : k + settings.batch]
            for group in opt.param_groups:  # cosine decay to 0: the last steps settle, not jitter
                group["lr"] = settings.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            step += 1
            loss = F.binary_cross_entropy_with_logits(z[idx] @ w + b, target[idx])
            reg = 0.5 * settings.weight_decay * (w * w).sum()
            opt.zero_grad()
            (loss + reg).backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
        if log is not None and (epoch == 0 or (epoch + 1) % 5 == 0 or epoch + 1 == settings.epochs):
            log(f"  fit: epoch {epoch + 1}/{settings.epochs}, BCE {losses[-1]:.4f}")
    head = ConfidenceHead(cfg)
    with torch.no_grad():  # fold the standardisation: w.(x - mu)/sd + b = (w/sd).x + (b - w.mu/sd)
        wf = w.detach() / sd
        head.confidence.weight.copy_(wf[: cfg.linear_width].float().unsqueeze(0))
        head.confidence.bias.copy_((b.detach() - (wf * mu).sum()).float().reshape(1))
        head.position_bias.copy_(wf[cfg.linear_width :].float())  # the one-hot's weights
    return head.eval(), losses


@torch.no_grad()
def predict(head: ConfidenceHead, ex: Examples) -> np.ndarray:
    w = torch.cat([head.confidence.weight[0], head.position_bias]).double()
    return torch.sigmoid(ex.inputs(head.cfg).double() @ w + head.confidence.bias.double()).numpy()


def write_head(head: ConfidenceHead, out_dir: Path, report: dict[str, Any]) -> Path:
    """``OUT/confidence/model.safetensors`` and ``confidence.json``; nothing else in ``out_dir`` is touched."""
    from safetensors.torch import save_file

    (out_dir / CONFIDENCE_DIR).mkdir(parents=True, exist_ok=True)
    path = out_dir / CONFIDENCE_WEIGHTS
    save_file(head.tensors(), str(path), metadata={"format": "pt"})
    (out_dir / CONFIDENCE_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return path


def train_confidence(
    model_dir: Path | str,
    data_dir: Path | str,
    out_dir: Path | str,
    settings: ConfidenceSettings | None = None,
    device: str = "cpu",
    log: Log | None = None,
) -> dict[str, Any]:
    """Fit the head on ``model_dir``'s drafts over the training split, score it on heldout-v1,
    write it under ``out_dir/confidence/``; returns ``confidence.json``'s contents."""
    from engine.train.model import load_trained

    s = settings if settings is not None else ConfidenceSettings()
    s.validate()
    log = log if log is not None else Log()
    t0 = time.monotonic()
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    torch.use_deterministic_algorithms(True, warn_only=True)
    data = Streams(data_dir)
    training_record(model_dir, data, data_dir)
    stream = {"valid": data.valid, "fit": data.train}.get(s.source)
    if stream is None:
        stream = read_array(data_dir, "train").astype(np.int64)
    if len(stream) < s.prompt_len + 1:
        raise ValueError(f"the {s.source} stream ({len(stream)} tokens) is shorter than one prompt")
    dev = torch.device(device)
    model = load_trained(model_dir, dev)
    cfg = s.head_config(ConfidenceConfig.from_dir(model_dir).hidden_size)
    log(
        f"model {model_dir} (hidden {cfg.hidden_size}); data {data_dir}: {s.prompts} {s.source} prompts "
        f"({len(stream):,} tokens), {s.eval_prompts} heldout-v1 prompts; {s.prompt_len}+{s.gen_tokens} tokens, "
        f"{s.depth} drafts per anchor; chains by {s.chains}"
    )
    timings: dict[str, float] = {}

    def collect(src: np.ndarray, n: int, what: str) -> Examples:
        t = time.monotonic()
        rows = prompt_rows(src, n, s.prompt_len, data.bos)
        log(f"{what}: greedy chains for {len(rows)} prompts")
        chains = make_chains(rows, s.gen_tokens, s.chains, model, model_dir, device, s.micro_batch)
        timings[f"{what}_chains_s"] = time.monotonic() - t
        t = time.monotonic()
        ex = draft_examples(model, chains, s.prompt_len, s.depth, s.micro_batch, log, what)
        timings[f"{what}_drafts_s"] = time.monotonic() - t
        per = [int((ex.position == j).sum()) for j in range(1, s.depth + 1)]
        log(
            f"{what}: {ex.anchors} anchors, {len(ex.label)} drafts reached (per position {per}), "
            f"{ex.label.mean():.3f} accepted"
        )
        return ex

    train_ex = collect(stream, s.prompts, "train")
    held_ex = collect(data.heldout, s.eval_prompts, "heldout")
    t = time.monotonic()
    head, losses = fit_head(train_ex.inputs(cfg), train_ex.label, s, log, cfg)
    timings["fit_s"] = time.monotonic() - t
    rate = float(train_ex.label.mean())
    pos_rates = [
        float(train_ex.label[train_ex.position == j].mean()) if (train_ex.position == j).any() else rate
        for j in range(1, s.depth + 1)
    ]
    fit_p = predict(head, train_ex)
    held = calibration(predict(head, held_ex), held_ex.label, held_ex.position, rate, pos_rates, s.bins)
    held["anchors"] = held_ex.anchors
    held["unconditional"] = held_ex.unconditional
    timings["total_s"] = time.monotonic() - t0
    report: dict[str, Any] = {
        "head": {
            "formula": f"p = sigmoid(w . [{' ; '.join(cfg.inputs.split(','))}] + b)",
            "inputs": cfg.inputs,
            "h": "MTP pass output: mtp.0.norm(mtp.0.hc_head(streams)) at the draft's position [D]",
            "e": "embed_tokens of the token the pass was fed (the previous draft; draft 1: the target's token) [D]",
            **(
                {"softmax": "of log_softmax(lm_head(h)): log p_max, log p_max - log p_second, entropy [3]"}
                if cfg.softmax
                else {}
            ),
            **({"position": f"one-hot of the draft's position 1..{cfg.positions}"} if cfg.positions else {}),
            "label": "draft equals the target's greedy token, given every earlier draft of the anchor accepted",
            "hidden_size": cfg.hidden_size,
            "weights": CONFIDENCE_WEIGHTS,
        },
        "settings": dataclasses.asdict(s),
        "model": {
            "dir": str(model_dir),
            "model_safetensors_sha256": file_sha256(model_dir / "model.safetensors"),
        },
        "data": {
            "corpus_digest": data.header["corpus"]["digest"],
            "split": data.header["split"],
            "tokenizer_sha256": data.header["tokenizer"]["sha256"],
            "train_sha256": data.header["arrays"]["train"]["sha256"],
            "heldout_sha256": data.header["arrays"]["heldout"]["sha256"],
            "source_tokens": len(stream),
        },
        "environment": run_environment(dev),
        "timings": timings,
        "fit": {
            "examples": len(train_ex.label),
            "anchors": train_ex.anchors,
            "accepted_rate": rate,
            "position_rates": pos_rates,
            "unconditional": train_ex.unconditional,
            "initial_bce": log_loss(np.full(len(train_ex.label), rate), train_ex.label),
            "epoch_bce": losses,
            "brier": brier(fit_p, train_ex.label),
        },
        "heldout": held,
    }
    write_head(head, out_dir, report)
    auc_text = "n/a" if held["auc"] is None else f"{held['auc']:.3f}"
    log(
        f"heldout-v1: {held['n']} drafts, Brier {held['brier']:.4f} (constant {held['brier_constant_train_rate']:.4f}, "
        f"per-position constant {held['brier_constant_per_position']:.4f}), AUC {auc_text}, ECE {held['ece']:.4f}"
    )
    log(f"wrote {out_dir / CONFIDENCE_WEIGHTS} in {timings['total_s']:.0f} s")
    return report
