"""How good is bounded replay? Greedy agreement and KL against exact state, at the runner level.

A prefix hit whose compressed blocks are cached but whose sliding-window slot is gone rebuilds
the slot by replaying the last ``r`` tokens of the hit (``engine.cache.swa``). ``r = L * (W - 1)``
is exact; DeepSeek's "bounded replay" uses ``r = W - 1``, which is approximate. Per prompt
(``hit + suffix`` token ids, the hit ``H`` a multiple of the block size):

- **exact**: the whole prompt is prefilled into a fresh slot (chunks of ``PREFILL_CHUNK``
  tokens, logits only at the end), then ``decode`` tokens are decoded greedily, one step each;
  the logits of every decoded position are kept (``D`` distributions, the first from the
  prefill);
- **bounded**: another slot, first filled with noise (stale state must not leak), sharing the
  exact path's blocks ``[0, H / block)`` with its own blocks for positions ``>= H``, replays
  ``[H - (W - 1), H)`` with ``rows_cached_until = H`` and ``window_from = H - (W - 1)`` (kept on
  every later step, as the scheduler does), then the suffix and the exact path's first
  ``D - 1`` decoded tokens in one forward (teacher forcing): its log-softmax at the ``D``
  positions the exact path decoded from, so both see the same contexts;
- **control**: the bounded path with ``r = L * (W - 1)``: agreement 1 and KL ~ 0, so the
  harness sees differences from the truncation only;
- **free run** (optional): the bounded path decoding greedily on its own; the number of
  leading tokens it shares with the exact path's decode;
- **host-slot variants** (optional, `SlotVariant`): the exact path's slot at ``H``, stored as a
  host slot would store it (``caches.pack_slot``: MXFP8, and/or only the first ``layers``
  layers) and loaded into a noisy slot; with fewer layers, the others are rebuilt by the
  bounded replay with the kept layers' exact windows held (``ForwardBatch.swa_keep``), as the
  engine does on such a hit; then teacher-forced like the bounded path.

Metrics per prompt: greedy agreement, the fraction of the ``D`` positions whose argmax equals
the exact path's; mean per-token ``KL(exact || bounded)`` in nats. Prompts run ``batch`` at a
time as one `ForwardBatch` per step (four slots per prompt).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import BLOCK_TOKENS
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig

PREFILL_CHUNK = 256
DEFAULT_SUFFIX = 64
DEFAULT_DECODE = 64
NOISE_SCALE = 100.0  # stale-state stand-in written into fresh slots and blocks before a replay
_FINGERPRINT = b"replay-quality\x00\x00"  # payloads never leave the process: any 16 bytes


@dataclass(frozen=True)
class SlotVariant:
    """A host slot's stored form: ``fmt`` ("native" or "mxfp8") and the first ``layers``
    layers kept (None: every layer, nothing replayed)."""

    fmt: str = "native"
    layers: int | None = None

    @property
    def name(self) -> str:
        return self.fmt + ("" if self.layers is None else f":{self.layers}")

    @classmethod
    def parse(cls, text: str) -> SlotVariant:
        """``"mxfp8"``, ``"native:4"``, ``"mxfp8:3"``; ValueError otherwise."""
        fmt, _, layers = text.partition(":")
        if fmt not in ("native", "mxfp8") or (layers and not layers.isdigit()) or layers == "0":
            raise ValueError(f"a slot variant is native|mxfp8[:LAYERS >= 1], got {text!r}")
        return cls(fmt, int(layers) if layers else None)


def exact_replay(layers: int, window: int) -> int:
    """Tokens an exact slot rebuild replays: ``L * (W - 1)`` (`engine.cache.swa`)."""
    return layers * (window - 1)


def default_hit(layers: int, window: int, block: int = BLOCK_TOKENS) -> int:
    """The smallest multiple of ``block`` strictly above ``L * (W - 1)``: bounded and exact replay
    differ, and the exact one fits inside the hit."""
    return (exact_replay(layers, window) // block + 1) * block


@dataclass(frozen=True)
class PromptQuality:
    agreement: float  # fraction of the D positions whose argmax matches the exact path's
    kl: float  # mean over the D positions of KL(exact || bounded), nats
    control_agreement: float  # the same with r = L * (W - 1)
    control_kl: float
    free_run: int | None  # leading tokens of the bounded path's own greedy decode equal to exact's
    variants: tuple[tuple[float, float], ...] = ()  # (agreement, KL) per host-slot variant


@dataclass(frozen=True)
class ReplayQuality:
    hit: int
    suffix: int
    decode: int
    layers: int
    window: int
    block: int
    replay: int  # W - 1
    exact_replay: int  # L * (W - 1)
    prompts: tuple[PromptQuality, ...]
    wall_s: float
    variants: tuple[SlotVariant, ...] = ()

    def variant_summary(self, k: int) -> dict[str, float | str]:
        agree = [p.variants[k][0] for p in self.prompts]
        return {
            "variant": self.variants[k].name,
            "mean_agreement": float(np.mean(agree)),
            "p10_agreement": float(np.percentile(agree, 10)),
            "mean_kl": float(np.mean([p.variants[k][1] for p in self.prompts])),
        }

    @property
    def mean_agreement(self) -> float:
        return float(np.mean([p.agreement for p in self.prompts]))

    @property
    def p10_agreement(self) -> float:
        """10th percentile of per-prompt agreement (numpy's linear interpolation)."""
        return float(np.percentile([p.agreement for p in self.prompts], 10))

    @property
    def mean_kl(self) -> float:
        return float(np.mean([p.kl for p in self.prompts]))

    @property
    def min_kl(self) -> float:
        return float(min(p.kl for p in self.prompts))

    @property
    def control_agreement(self) -> float:
        """The lowest control agreement over prompts (1.0 when the harness is sound)."""
        return float(min(p.control_agreement for p in self.prompts))

    @property
    def control_kl(self) -> float:
        """The largest per-prompt control KL (in absolute value)."""
        return float(max(abs(p.control_kl) for p in self.prompts))

    @property
    def mean_free_run(self) -> float | None:
        runs = [p.free_run for p in self.prompts if p.free_run is not None]
        return float(np.mean(runs)) if runs else None

    def summary(self) -> dict[str, Any]:
        return {
            "prompts": len(self.prompts),
            "hit": self.hit,
            "suffix": self.suffix,
            "decode": self.decode,
            "layers": self.layers,
            "window": self.window,
            "replay": self.replay,
            "exact_replay": self.exact_replay,
            "mean_agreement": self.mean_agreement,
            "p10_agreement": self.p10_agreement,
            "mean_kl": self.mean_kl,
            "min_kl": self.min_kl,
            "control_agreement": self.control_agreement,
            "control_kl": self.control_kl,
            "mean_free_run": self.mean_free_run,
            "wall_s": self.wall_s,
            "variants": [self.variant_summary(k) for k in range(len(self.variants))],
        }


# ---------------------------------------------------------------------------- measurement
def _logits_at(runner: ModelRunner, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits at flat token ``rows`` from a forward's final streams (`DeepseekV4.forward`'s head)."""
    m = runner.model
    with torch.inference_mode():
        return m.lm_head(m.model.norm(m.model.hc_head(hidden[rows]))).float()


def _kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Per-row KL(softmax(p) || softmax(q)) in nats, the log-softmax taken in float64 (so a KL
    of identical logits is 0 and rounding never makes one negative beyond ~1e-15)."""
    p = torch.log_softmax(logits_p.double(), -1)
    q = torch.log_softmax(logits_q.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def _scramble(runner: ModelRunner, slots: Sequence[int], blocks: Sequence[int], g: torch.Generator) -> None:
    for s in slots:
        for t in runner.swa.slot_tensors(s):
            t.copy_(torch.randn(t.shape, generator=g) * NOISE_SCALE)
    for b in blocks:
        for t in runner.pool.block_tensors(b):
            t.copy_(torch.randn(t.shape, generator=g) * NOISE_SCALE)


class _Layout:
    """Slots and blocks of one batch of ``b`` prompts: per prompt an exact path owning every block,
    and bounded / control / free-run paths sharing the hit's blocks with their own after it."""

    def __init__(self, b: int, hit: int, total: int, block: int, variants: int = 0) -> None:
        self.b = b
        self.need = math.ceil(total / block)
        self.shared = hit // block
        self.own = self.need - self.shared
        self.paths = 4 + variants  # exact, bounded, control, free run, then the variants

    def slot(self, path: int, i: int) -> int:
        return path * self.b + i

    def table(self, path: int, i: int) -> list[int]:
        exact = list(range(i * self.need, (i + 1) * self.need))
        if path == 0:
            return exact
        base = self.b * self.need + ((path - 1) * self.b + i) * self.own
        return exact[: self.shared] + list(range(base, base + self.own))

    @property
    def num_blocks(self) -> int:
        return self.b * self.need + (self.paths - 1) * self.b * self.own

    @property
    def num_slots(self) -> int:
        return self.paths * self.b


def _step(runner: ModelRunner, seqs: list[SequenceInput]):
    return runner.execute(ForwardBatch.from_sequences(seqs, runner.cfg.device))


def _exact_path(
    runner: ModelRunner,
    lay: _Layout,
    prompts: Sequence[Sequence[int]],
    hit: int,
    decode: int,
    variants: Sequence[SlotVariant],
    digest: bytes,
) -> tuple[torch.Tensor, torch.Tensor, list[list[bytes]]]:
    """Path 0: chunked prefill, then greedy decode keeping the logits of every decoded position.
    Returns the logits [b, D, V], the tokens [b, D] and, per variant and prompt, the slot at
    the hit stored in the variant's form."""
    from engine.kvconnector import caches

    b, plen = len(prompts), len(prompts[0])
    saved: list[list[bytes]] = [[] for _ in variants]
    logits = None
    for a in range(0, plen, PREFILL_CHUNK):
        e = min(plen, a + PREFILL_CHUNK)
        seqs = [
            SequenceInput(p[a:e], a, lay.slot(0, i), lay.table(0, i), e == plen)
            for i, p in enumerate(prompts)
        ]
        logits = _step(runner, seqs).logits
        if e == hit:  # a chunk ends at the hit (both are block multiples): store the slot there
            for v, var in enumerate(variants):
                saved[v] = [
                    caches.pack_slot(
                        runner.swa, lay.slot(0, i), _FINGERPRINT, digest, fmt=var.fmt, layers=var.layers
                    )
                    for i in range(b)
                ]
    assert logits is not None
    assert all(len(x) == b for x in saved), "the hit must end a prefill chunk"
    exact_logits = [logits]
    tokens = [logits.argmax(-1)]
    for k in range(1, decode):
        seqs = [
            SequenceInput([int(tokens[-1][i])], plen + k - 1, lay.slot(0, i), lay.table(0, i))
            for i in range(b)
        ]
        logits = _step(runner, seqs).logits
        exact_logits.append(logits)
        tokens.append(logits.argmax(-1))
    return torch.stack(exact_logits, 1), torch.stack(tokens, 1), saved


def _free_run(
    runner: ModelRunner,
    lay: _Layout,
    plen: int,
    window_from: int,
    first: torch.Tensor,
    want_ids: torch.Tensor,
) -> list[int]:
    """The free-run path (3) decodes greedily from ``first`` on its own; per prompt, the number
    of leading tokens equal to the exact path's ``want_ids``."""
    b, decode = want_ids.shape
    free = [first]
    for k in range(1, decode):
        seqs = [
            SequenceInput(
                [int(free[-1][i])], plen + k - 1, lay.slot(3, i), lay.table(3, i), True, 0, window_from
            )
            for i in range(b)
        ]
        free.append(_step(runner, seqs).logits.argmax(-1))
    same = (torch.stack(free, 1) == want_ids).long()
    return [int(x) for x in same.cumprod(1).sum(1)]


def _measure_batch(
    runner: ModelRunner,
    lay: _Layout,
    prompts: Sequence[Sequence[int]],
    hit: int,
    decode: int,
    replays: tuple[int, int],
    free_run: bool,
    g: torch.Generator,
    variants: Sequence[SlotVariant] = (),
) -> list[PromptQuality]:
    from engine.kvconnector import caches
    from engine.kvconnector.payload import layout_digest

    b, plen = len(prompts), len(prompts[0])
    digest = layout_digest(runner.spec, runner.cfg.torch_dtype)
    want, want_ids, saved = _exact_path(runner, lay, prompts, hit, decode, variants, digest)

    # bounded (path 1), control (path 2), free run (path 3), variants (4 + v): fresh noisy
    # slots and own blocks; a variant's slot then gets its stored form of the exact slot
    var_paths = [4 + v for v in range(len(variants))]
    paths = [1, 2, 3] if free_run else [1, 2]
    paths += var_paths
    r_of = {1: replays[0], 2: replays[1], 3: replays[0]}
    keep_of: dict[int, tuple[int, int]] = {}
    for v, var in enumerate(variants):
        r_of[4 + v] = 0 if var.layers is None else replays[0]
        keep_of[4 + v] = (0, 0) if var.layers is None else (var.layers, hit)
    _scramble(
        runner,
        [lay.slot(p, i) for p in paths for i in range(b)],
        [blk for p in paths for i in range(b) for blk in lay.table(p, i)[lay.shared :]],
        g,
    )
    for v in range(len(variants)):
        for i in range(b):
            caches.unpack_slot_into(saved[v][i], runner.swa, lay.slot(4 + v, i), _FINGERPRINT, digest)
    seqs = []
    for p in paths:
        r = r_of[p]
        if r == 0:
            continue
        for i, pr in enumerate(prompts):
            seqs.append(
                SequenceInput(
                    pr[hit - r : hit], hit - r, lay.slot(p, i), lay.table(p, i), False, hit, hit - r,
                    keep_of.get(p, (0, 0)),
                )
            )  # fmt: skip
    _step(runner, seqs)
    seqs = []
    row_of: dict[int, int] = {}  # path -> index of its first sequence in the batch
    for p in paths:
        row_of[p] = len(seqs)
        window_from = hit - r_of[p] if r_of[p] else 0
        for i, pr in enumerate(prompts):
            ids = list(pr[hit:]) + (want_ids[i, :-1].tolist() if p != 3 else [])
            seqs.append(
                SequenceInput(
                    ids, hit, lay.slot(p, i), lay.table(p, i), True, 0, window_from, keep_of.get(p, (0, 0))
                )
            )
    batch = ForwardBatch.from_sequences(seqs, runner.cfg.device)
    out = runner.execute(batch)
    suffix = plen - hit
    starts = batch.query_start_cpu
    got: dict[int, torch.Tensor] = {}
    for p in [1, 2, *var_paths]:
        j = row_of[p]
        rows = torch.tensor(
            [starts[j + i] + suffix - 1 + k for i in range(b) for k in range(decode)], dtype=torch.long
        )
        got[p] = _logits_at(runner, out.hidden, rows).view(b, decode, -1)
    runs: list[int | None] = [None] * b
    if free_run:
        first = out.logits[row_of[3] : row_of[3] + b].argmax(-1)
        runs = list(_free_run(runner, lay, plen, hit - replays[0], first, want_ids))
    out_q = []
    for i in range(b):
        agree = {p: float((got[p][i].argmax(-1) == want_ids[i]).double().mean()) for p in got}
        kl = {p: float(_kl(want[i], got[p][i]).mean()) for p in got}
        out_q.append(
            PromptQuality(
                agree[1], kl[1], agree[2], kl[2], runs[i], tuple((agree[p], kl[p]) for p in var_paths)
            )
        )
    return out_q


def measure(
    model_dir: str | Path | None,
    prompts: Sequence[Sequence[int]],
    hit: int | None = None,
    decode: int = DEFAULT_DECODE,
    *,
    batch: int = 16,
    free_run: bool = True,
    runner: ModelRunner | None = None,
    progress: Callable[[int, int], None] | None = None,
    seed: int = 0,
    variants: Sequence[SlotVariant] = (),
) -> ReplayQuality:
    """Bounded (``W - 1``) and exact-control (``L * (W - 1)``) replay against exact state for each
    prompt (all of one length ``hit + S``); ``hit`` defaults to `default_hit`. The checkpoint in
    ``model_dir`` runs in fp32 on the CPU unless ``runner`` is given (it needs ``(4 + len(variants)) * batch`` slots
    and enough blocks: ValueError otherwise). ``batch`` prompts share each forward."""
    if not prompts:
        raise ValueError("measure needs at least one prompt")
    plen = len(prompts[0])
    if any(len(p) != plen for p in prompts):
        raise ValueError("every prompt must have the same length (hit + suffix)")
    if decode < 1 or batch < 1:
        raise ValueError("decode and batch must be >= 1")
    t0 = time.perf_counter()
    if runner is None:
        if model_dir is None:
            raise ValueError("give model_dir or runner")
        from engine.config import ModelConfig

        mc = ModelConfig.from_dir(model_dir)
        hit = hit if hit is not None else default_hit(mc.num_hidden_layers, mc.sliding_window)
        lay = _Layout(min(batch, len(prompts)), hit, plen + decode, BLOCK_TOKENS, len(variants))
        runner = ModelRunner(
            model_dir, RunnerConfig(num_blocks=lay.num_blocks, num_slots=lay.num_slots, with_mtp=False)
        )
    cfg = runner.model_cfg
    layers, window, block = cfg.num_hidden_layers, cfg.sliding_window, BLOCK_TOKENS
    hit = hit if hit is not None else default_hit(layers, window)
    exact = exact_replay(layers, window)
    if hit % block or hit < exact or plen <= hit:
        raise ValueError(
            f"hit {hit} must be a multiple of {block}, at least L*(W-1) = {exact} and below the "
            f"prompt length {plen}"
        )
    lay = _Layout(min(batch, len(prompts)), hit, plen + decode, block, len(variants))
    if runner.cfg.num_slots < lay.num_slots or runner.cfg.num_blocks < lay.num_blocks:
        raise ValueError(f"the runner needs {lay.num_slots} slots and {lay.num_blocks} blocks")
    g = torch.Generator().manual_seed(seed)
    results: list[PromptQuality] = []
    for a in range(0, len(prompts), lay.b):
        chunk = prompts[a : a + lay.b]
        part = _Layout(len(chunk), hit, plen + decode, block, len(variants))
        results += _measure_batch(
            runner, part, chunk, hit, decode, (window - 1, exact), free_run, g, variants
        )
        if progress is not None:
            progress(len(results), len(prompts))
    wall = time.perf_counter() - t0
    return ReplayQuality(
        hit, plen - hit, decode, layers, window, block, window - 1, exact, tuple(results), wall,
        tuple(variants),
    )  # fmt: skip
