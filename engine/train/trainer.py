"""``sluice train model``: train the trained preset on a ``sluice train data`` directory.

The run is a pure function of (data directory, settings, device kind): the model is built
from the seed, and the batches follow a seeded order. Each epoch cuts the training stream
into ``seq_len``-token windows from a seeded random offset and visits them in a seeded
permutation; a window is fed as ``[BOS] + tokens[:-1]`` and predicts ``tokens``. The
``valid-v1`` files never train: they are the loss curve's validation points (the baselines
tune their smoothing on the same slice). ``heldout-v1`` is scored once, at the end.

Output directory: a checkpoint in the Hugging Face layout (``config.json``,
``generation_config.json``, ``model.safetensors``, the data directory's tokenizer), with
``curve.jsonl`` (one JSON line per step and per validation point) and ``training.json``
(settings, data digests, timings, the final measures).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from engine.train.data import read_array
from engine.train.evaluate import mtp_acceptance, score_stream
from engine.train.model import TrainModel, export_state, model_config
from engine.train.settings import TrainSettings
from engine.train.state import STATE_DIR, load_state, open_curve, save_state

PRESET_NAME = "trained"


class Streams:
    """The data directory's token streams: training (minus valid-v1), valid-v1 and held-out."""

    def __init__(self, data_dir: Path) -> None:
        self.header = json.loads((data_dir / "data.json").read_text(encoding="utf-8"))
        train = read_array(data_dir, "train")
        files = self.header["arrays"]["train"]["files"]
        fit = [train[f["offset"] : f["offset"] + f["n_tokens"]] for f in files if not f["valid"]]
        valid = [train[f["offset"] : f["offset"] + f["n_tokens"]] for f in files if f["valid"]]
        self.train = np.concatenate(fit).astype(np.int64)
        self.valid = np.concatenate(valid).astype(np.int64) if valid else self.train[:0]
        self.heldout = read_array(data_dir, "heldout").astype(np.int64)
        tok = self.header["tokenizer"]
        self.vocab_size, self.bos, self.eos = int(tok["vocab_size"]), int(tok["bos"]), int(tok["eos"])


def batches(stream: np.ndarray, s: TrainSettings, first: int = 0) -> Any:
    """Yield (windows [batch, seq_len], epochs begun) for steps ``first`` .. ``s.steps - 1`` in
    the seeded order; the steps before ``first`` (a resumed run's) are drawn but not built."""
    n = len(stream)
    if n < s.seq_len + 1:
        raise ValueError(f"the training stream ({n} tokens) is shorter than one window ({s.seq_len})")
    epoch = 0
    pending: list[int] = []
    for step in range(s.steps):
        while len(pending) < s.batch:
            rng = np.random.default_rng([s.seed, epoch])
            offset = int(rng.integers(0, s.seq_len))
            starts = np.arange(offset, n - s.seq_len + 1, s.seq_len)
            if len(starts) == 0:
                starts = np.array([0])
            pending.extend(int(v) for v in rng.permutation(starts))
            epoch += 1
        take, pending = pending[: s.batch], pending[s.batch :]
        if step >= first:
            yield np.stack([stream[a : a + s.seq_len] for a in take]), epoch


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - 1 - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _param_groups(model: TrainModel, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linears, embeddings, experts); none on norms, sinks, biases, mHC scales."""
    decay: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for _name, p in model.named_parameters():
        (decay if p.ndim >= 2 else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class Log:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)


def _eval_batch(dev: torch.device, seq_len: int, micro_batch: int) -> int:
    """Windows per scoring forward: it keeps no activations for backward, so 32K tokens on a GPU;
    8K on a CPU, where transformers' eager attention holds [heads, seq, seq] scores per window."""
    return max(micro_batch, (32768 if dev.type == "cuda" else 8192) // seq_len)


def run_environment(dev: torch.device) -> dict[str, Any]:
    """Where a training stage ran, for its JSON record."""
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def trained_environment(dev: torch.device) -> dict[str, Any]:
    """``run_environment`` after a training stage, with its peak GPU memory (None on the CPU)."""
    peak = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if dev.type == "cuda" else None
    return {**run_environment(dev), "peak_gpu_memory_gb": peak}


def _fmt_eta(seconds: float) -> str:
    m, sec = divmod(int(seconds), 60)
    return f"{m}m{sec:02d}s"


def training_device(device: str) -> torch.device:
    """The device a training stage runs on, set up for repeatable runs: deterministic
    algorithms, TF32 matmuls on a GPU (bitwise-repeatable cuBLAS also needs
    CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    return dev


def train(
    data_dir: Path,
    out_dir: Path,
    settings: TrainSettings,
    device: str = "cpu",
    model_overrides: dict[str, Any] | None = None,
    log: Log | None = None,
    stop_after: int | None = None,
    resume: bool = False,
) -> dict[str, Any] | None:
    """Train, write the checkpoint into ``out_dir`` and return ``training.json``'s contents.

    ``stop_after`` ends this call after that many steps in all, saving the full training state
    in ``out_dir/state`` (and returning None); ``resume`` continues from that state, so a run
    longer than one sitting is split into calls with bit-identical results on the same device.
    """
    settings.validate()
    log = log if log is not None else Log()
    dev = training_device(device)
    data = Streams(data_dir)
    cfg = model_config(data.vocab_size, data.bos, data.eos, **(model_overrides or {}))
    log(
        f"data {data_dir}: {len(data.train):,} training tokens (valid-v1 excluded: {len(data.valid):,}), "
        f"{len(data.heldout):,} held out; vocabulary {data.vocab_size}"
    )
    model = TrainModel(cfg, settings.seed, settings.bias_rate).to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters, {cfg['num_hidden_layers']} layers + 1 MTP layer, on {dev}")
    opt = torch.optim.AdamW(
        _param_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.95), eps=1e-8
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    identity = {"settings": dataclasses.asdict(settings), "model_overrides": model_overrides or {},
                "train_sha256": data.header["arrays"]["train"]["sha256"], "device": dev.type}  # fmt: skip
    first, before = load_state(out_dir, model, opt, identity) if resume else (0, 0.0)
    if resume:
        log(f"resumed at step {first}/{settings.steps} from {out_dir / STATE_DIR}")
    curve = open_curve(out_dir / "curve.jsonl", first)
    tokens_per_step = settings.batch * settings.seq_len
    eval_batch = _eval_batch(dev, settings.seq_len, settings.micro_batch)
    t_start = time.monotonic() - before
    last = {}
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    try:
        for step, (y_np, epoch) in enumerate(batches(data.train, settings, first), start=first):
            if step >= end:
                break
            lr = lr_at(step, settings)
            for group in opt.param_groups:
                group["lr"] = lr
            sums = {"lm": 0.0, "mtp": 0.0, "indexer": 0.0}
            n_micro = settings.batch // settings.micro_batch
            for m in range(n_micro):
                y = torch.from_numpy(y_np[m * settings.micro_batch : (m + 1) * settings.micro_batch]).to(dev)
                x = torch.cat([torch.full_like(y[:, :1], data.bos), y[:, :-1]], dim=1)
                losses = model(x, y)
                loss = losses["lm"] + settings.mtp_weight * losses["mtp"] + losses["indexer"]
                (loss / n_micro).backward()
                for k in sums:
                    sums[k] += float(losses[k].detach()) / n_micro
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            max_load = model.balancer.update()
            elapsed = time.monotonic() - t_start
            done = step + 1
            rate = done * tokens_per_step / elapsed
            last = {
                "step": done, "epoch": epoch, "lr": lr, **sums, "grad_norm": grad_norm,
                "max_load": max_load, "tokens": done * tokens_per_step, "elapsed_s": elapsed,
            }  # fmt: skip
            curve.write(json.dumps(last) + "\n")
            if done == 1 or done % 10 == 0 or done == settings.steps:
                log(
                    f"step {done}/{settings.steps} loss {sums['lm']:.4f} mtp {sums['mtp']:.4f} "
                    f"indexer {sums['indexer']:.4f} lr {lr:.2e} max/mean expert load {max_load:.2f} "
                    f"{rate:,.0f} tok/s eta {_fmt_eta((settings.steps - done) * elapsed / done)}"
                )
            if len(data.valid) and (done % settings.eval_every == 0 or done == settings.steps):
                v = score_stream(
                    model,
                    data.valid,
                    settings.seq_len,
                    data.bos,
                    dev,
                    settings.micro_batch,
                    settings.eval_windows,
                )
                curve.write(json.dumps({"step": done, "valid_nll": v["nll"], "valid_ppl": v["ppl"]}) + "\n")
                curve.flush()
                log(f"  valid-v1: nll {v['nll']:.4f} ppl {v['ppl']:.2f} ({v['tokens']:,} tokens)")
    finally:
        curve.close()
    train_s = time.monotonic() - t_start
    if end < settings.steps:
        save_state(out_dir, model, opt, identity, end, train_s)
        log(
            f"stopped after step {end}/{settings.steps}; state saved in {out_dir / STATE_DIR} (--resume continues)"
        )
        return None
    log(f"trained {settings.steps} steps in {_fmt_eta(train_s)}; scoring heldout-v1")
    measures = _measure(model, data, dev, settings.seq_len, eval_batch, settings.accept_prompts, log)
    info = {
        "preset": PRESET_NAME,
        "settings": dataclasses.asdict(settings),
        "model_overrides": model_overrides or {},
        "attention": model.lm.config._attn_implementation,
        "data": {
            "corpus_digest": data.header["corpus"]["digest"],
            "split": data.header["split"],
            "tokenizer_sha256": data.header["tokenizer"]["sha256"],
            "train_sha256": data.header["arrays"]["train"]["sha256"],
            "heldout_sha256": data.header["arrays"]["heldout"]["sha256"],
            "train_tokens_used": int(len(data.train)),
        },
        "environment": trained_environment(dev),
        "train_seconds": round(train_s, 1),
        "final_step": last,
        **measures,
    }
    write_checkpoint(model, out_dir, data_dir, info)
    shutil.rmtree(out_dir / STATE_DIR, ignore_errors=True)  # a finished run has nothing to resume
    log(f"wrote {out_dir}")
    return info


def _measure(
    model: TrainModel,
    data: Streams,
    dev: torch.device,
    seq_len: int,
    eval_batch: int,
    accept_prompts: int,
    log: Log,
) -> dict[str, Any]:
    """Held-out perplexity beside the baselines, and the MTP layer's draft acceptance."""
    held = score_stream(model, data.heldout, seq_len, data.bos, dev, eval_batch)
    log(f"heldout-v1: ppl {held['ppl']:.2f} over {held['tokens']:,} tokens")
    accept = mtp_acceptance(
        model, data.heldout, data.bos, dev, n_prompts=accept_prompts, prompt_len=min(256, seq_len)
    )
    log(
        "MTP acceptance (given earlier drafts accepted): "
        + ", ".join(f"{a:.3f}" for a in accept["conditional"])
    )
    base = data.header["baselines"]
    return {
        "heldout": {
            "ppl": held["ppl"],
            "nll": held["nll"],
            "tokens": held["tokens"],
            "seq_len": seq_len,
            "unigram_ppl": base["unigram_heldout_ppl"],
            "bigram_ppl": base["bigram_heldout_ppl"],
            "ratio_to_bigram": held["ppl"] / base["bigram_heldout_ppl"],
        },
        "mtp_acceptance": accept,
    }


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of the file at ``path`` (a checkpoint's weights, for its records)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def training_record(model_dir: Path | str, data: Streams, data_dir: Path | str) -> dict[str, Any]:
    """A checkpoint's ``training.json`` ({} when it has none); raises ``ValueError`` when it was
    trained with another tokenizer than ``data``'s (read from ``data_dir``)."""
    path = Path(model_dir) / "training.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    want = record.get("data", {}).get("tokenizer_sha256")
    if want is not None and want != data.header["tokenizer"]["sha256"]:
        raise ValueError(f"{model_dir} was trained with another tokenizer than {data_dir}'s")
    return record


@dataclasses.dataclass(frozen=True)
class Continued:
    """What a stage that continues a trained checkpoint (`sluice train drafter`,
    `sluice train unlikelihood`) starts from (`continue_checkpoint`): the input checkpoint and
    the output directory, the data and the device, and the input's own ``training.json`` and
    weights' hash, which the new checkpoint's record names (`record`)."""

    model_dir: Path
    data_dir: Path
    out_dir: Path
    data: Streams
    device: torch.device
    base_info: dict[str, Any]
    base_sha: str

    def record(self) -> dict[str, Any]:
        """The new checkpoint's ``training.json`` entries on where it came from."""
        tokenizer = {"tokenizer_sha256": self.data.header["tokenizer"]["sha256"]}
        return {
            "base": {"model_safetensors_sha256": self.base_sha, "training": self.base_info},
            "data": self.base_info.get("data", tokenizer),
            "environment": trained_environment(self.device),
        }


def continue_checkpoint(
    model_dir: Path | str, data_dir: Path | str, out_dir: Path | str, device: str
) -> Continued:
    """The checks and records a continuing stage starts with: ``out_dir`` is not ``model_dir``
    (the input checkpoint is read, never rewritten), the device can train, and the data is
    tokenized as the input was trained (`training_record`)."""
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from --model: the input checkpoint is read, not rewritten")
    dev = training_device(device)
    data = Streams(data_dir)
    info = training_record(model_dir, data, data_dir)
    return Continued(
        model_dir, data_dir, out_dir, data, dev, info, file_sha256(model_dir / "model.safetensors")
    )


def evaluate_checkpoint(
    model_dir: Path | str,
    data_dir: Path | str,
    device: str = "cpu",
    seq_len: int = 4096,
    accept_prompts: int = 64,
    log: Log | None = None,
) -> dict[str, Any]:
    """`sluice train eval`: the trained measures of a written checkpoint (its stored weights, in fp32)."""
    from engine.train.model import load_trained

    log = log if log is not None else Log()
    data = Streams(Path(data_dir))
    training_record(model_dir, data, data_dir)
    dev = torch.device(device)
    model = load_trained(model_dir, dev)
    return _measure(model, data, dev, seq_len, _eval_batch(dev, seq_len, 1), accept_prompts, log)


def write_checkpoint(model: TrainModel, out_dir: Path, data_dir: Path, info: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    state = export_state(model)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model.cfg)
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    cfg["sluice"] = {"preset": PRESET_NAME, "seed": info["settings"]["seed"]}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data_dir / name, out_dir / name)
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
