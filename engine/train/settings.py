"""The training stages' settings (``sluice train model``, ``unlikelihood``, ``drafter``, ``confidence``):
plain dataclasses, importable without torch, so the CLI can show their defaults in its help
without loading torch (about 2 s of every ``sluice`` command)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model.confidence import ConfidenceConfig

SOURCES = ("train", "valid", "fit")
CHAINS = ("engine", "recompute")


@dataclass(frozen=True)
class TrainSettings:
    """The shipped settings are the defaults; ``docs/training.md`` states why each is what it is."""

    seed: int = 0
    seq_len: int = 4096
    batch: int = 16  # sequences per optimizer step (65,536 tokens)
    micro_batch: int = 16  # sequences per forward/backward
    steps: int = 480
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 24
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    bias_rate: float = 1e-2
    eval_every: int = 40
    eval_windows: int = 16
    accept_prompts: int = 64

    def validate(self) -> None:
        if self.seq_len < 8 or self.batch < 1 or self.micro_batch < 1 or self.steps < 1:
            raise ValueError("seq_len >= 8, batch >= 1, micro_batch >= 1 and steps >= 1 are required")
        if self.batch % self.micro_batch:
            raise ValueError(f"batch ({self.batch}) must be a multiple of micro_batch ({self.micro_batch})")
        if not 0 <= self.warmup < self.steps:
            raise ValueError("warmup must be in [0, steps)")


@dataclass(frozen=True)
class UnlikelihoodSettings:
    alpha: float = 3.0  # weight of the unlikelihood term beside the cross-entropy
    window: int = 128  # previous positions whose tokens are negative candidates
    steps: int = 60
    lr: float = 2e-4  # constant after warm-up: the model stage's final rate (2e-3 x 0.1)
    warmup: int = 5
    seed: int = 0  # the batches' order (the model stage's, for the same seed)
    seq_len: int = 4096
    batch: int = 16
    micro_batch: int = 16
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    accept_prompts: int = 64

    def validate(self) -> None:
        if self.alpha < 0 or self.window < 1 or self.steps < 1 or self.lr <= 0 or self.warmup < 0:
            raise ValueError(f"bad UnlikelihoodSettings {self}")
        if self.batch % self.micro_batch:
            raise ValueError(f"batch {self.batch} is not a multiple of micro_batch {self.micro_batch}")

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.lr


@dataclass(frozen=True)
class DrafterSettings:
    """``sluice train drafter``: the MTP layer distilled from the frozen target (docs/training.md)."""

    steps: int = 120
    seq_len: int = 1024  # tokens per window: the MTP layer reads 128, the trunk's CSA/HCA the rest
    batch: int = 4  # windows per step (4,096 tokens)
    depth: int = 5  # chained passes trained: the drafts a step proposes
    lr: float = 5e-4  # AdamW's peak; cosine to min_lr_ratio of it
    min_lr_ratio: float = 0.1
    warmup: int = 6  # 5 % of the steps
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0  # the windows' order (the model stage's batches for this seed and shape)
    accept_prompts: int = 64
    # > 0: a confidence head sigmoid(Linear([h ; e])) trains beside the drafter, its BCE on
    # each draft's top-1 agreement at this weight, so that h carries what the head needs
    # (the head does not ship: `sluice train confidence` fits the shipped one; it is kept
    # beside the checkpoint as `engine.train.drafter.JOINT_HEAD` for a continuation)
    confidence_weight: float = 0.0
    # with confidence_weight > 0: a checkpoint directory whose fitted head
    # (`confidence/model.safetensors`) starts the head, or a head an earlier run kept (its
    # `confidence_joint.safetensors` file); "" starts it at zero, where it passes no gradient
    # to h until its weights have grown
    confidence_from: str = ""
    # the head's peak learning rate (`sluice train confidence`'s), on the drafter's schedule
    confidence_lr: float = 3e-3

    def validate(self) -> None:
        if self.confidence_weight < 0 or self.confidence_lr <= 0:
            raise ValueError("confidence_weight must be >= 0 and confidence_lr > 0")
        if self.confidence_from and self.confidence_weight == 0:
            raise ValueError("confidence_from needs confidence_weight > 0 (the head trains only then)")
        if self.steps < 1 or self.seq_len < self.depth + 2 or self.batch < 1 or self.depth < 1:
            raise ValueError("steps >= 1, batch >= 1, depth >= 1 and seq_len >= depth + 2 are required")
        if self.lr <= 0 or not 0 < self.min_lr_ratio <= 1 or not 0 <= self.warmup < self.steps:
            raise ValueError("lr > 0, 0 < min_lr_ratio <= 1 and 0 <= warmup < steps are required")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class ConfidenceSettings:
    """The shipped head's settings are the defaults (``docs/training.md``, "Confidence head")."""

    seed: int = 0
    source: str = "train"  # training prompts: "train" (the training split), "valid" (its valid-v1 files), "fit" (the rest)
    prompts: int = 1024  # training prefixes
    eval_prompts: int = 256  # held-out prefixes
    prompt_len: int = 256
    gen_tokens: int = 32
    depth: int = 5
    micro_batch: int = 16  # chains per drafting forward
    epochs: int = 10
    batch: int = 256
    lr: float = 3e-3  # Adam's peak; cosine decay to 0 over the run
    weight_decay: float = 1e-2  # L2 on the standardised weights (not the bias)
    bins: int = 10
    chains: str = "engine"  # "engine" (KV-cached greedy decoding) or "recompute" (evaluate.greedy_chains)
    # the head's inputs: "h,e" (the MTP pass's output and the fed token's embedding), then
    # optionally "softmax" (3 features of the draft distribution) and "position" (one-hot, depth)
    inputs: str = "h,e"

    def head_config(self, hidden_size: int) -> ConfidenceConfig:
        """The head these ``inputs`` name, for a model of ``hidden_size`` (a position bias per
        draft, ``depth`` of them, where it reads ``position``); ValueError for bad inputs."""
        from engine.model.confidence import ConfidenceConfig  # torch: only when a run starts

        reads_position = "position" in (n.strip() for n in self.inputs.split(","))
        return ConfidenceConfig.parse(hidden_size, self.inputs, self.depth if reads_position else 0)

    def validate(self) -> None:
        self.head_config(1)
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.chains not in CHAINS:
            raise ValueError(f"chains must be one of {CHAINS}, got {self.chains!r}")
        if self.prompts < 1 or self.eval_prompts < 1 or self.micro_batch < 1 or self.batch < 1:
            raise ValueError("prompts, eval_prompts, micro_batch and batch must be >= 1")
        if self.prompt_len < 2 or self.depth < 1 or self.gen_tokens < self.depth + 2:
            raise ValueError("prompt_len >= 2, depth >= 1 and gen_tokens >= depth + 2 are required")
        if self.epochs < 1 or self.lr <= 0 or self.bins < 1:
            raise ValueError("epochs >= 1, lr > 0 and bins >= 1 are required")
