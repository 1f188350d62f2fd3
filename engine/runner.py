"""`ModelRunner`: owns the model and its caches; ``execute(ForwardBatch) -> RunnerOutput``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from engine.cache.pool import CompressedPool
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.checkpoint.loader import load_weights
from engine.checkpoint.random_init import randomize_
from engine.config import ModelConfig
from engine.cuda_graphs import MAX_GRAPH_QUERY, DecodeGraphs, graphable
from engine.distributed.ep import select_dispatch
from engine.forward_batch import ForwardBatch, upload
from engine.kernels import batch_invariant, fp8
from engine.model import verify
from engine.model.experts import GROUPED_MM
from engine.model.layer import DecoderLayer
from engine.model.model import DeepseekV4
from engine.model.moe import ExpertPlacement
from engine.model.qlinear import graph_safe, keep_fp8_

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    num_blocks: int = 64  # physical compressed-state blocks (256 positions each)
    num_slots: int = 8  # SWA slots (max concurrent sequences)
    dtype: str = "float32"
    device: str = "cpu"
    with_mtp: bool = True
    keep_quantized: bool = False  # FP8/FP4 weights stay quantised on the device, dequantised per use
    # how FP8 weights multiply (engine.kernels.fp8): "w8a16", or "w8a8" (process-wide once on)
    fp8_compute: str = "w8a16"
    ep_size: int = 1
    ep_rank: int = 0
    # decode steps as CUDA graphs (engine.cuda_graphs): "auto" = on CUDA without expert
    # parallelism; "off"; "padded" = the graphs' padded batches run eagerly (tests, debugging)
    decode_graphs: str = "auto"
    # CUDA: a request's results do not depend on its batch (engine/kernels/batch_invariant.py;
    # process-wide once on). CPU: nothing to switch; its kernels already are for these models
    batch_invariant: bool = False
    # a step mixing decode rows with prompts runs as two passes (`ModelRunner.split`); False:
    # one pass (the A/B of `sluice bench engine --mixed`)
    split_mixed_steps: bool = True

    def __post_init__(self) -> None:
        if self.fp8_compute not in fp8.COMPUTES:
            raise ValueError(f"fp8_compute must be one of {fp8.COMPUTES}, not {self.fp8_compute!r}")
        if self.decode_graphs not in ("auto", "off", "padded"):
            raise ValueError(f"decode_graphs must be auto, off or padded, not {self.decode_graphs!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} unknown; known: {sorted(_DTYPES)}")
        if self.num_blocks < 1 or self.num_slots < 1:
            raise ValueError("num_blocks and num_slots must be >= 1")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} must be in [0, ep_size={self.ep_size})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_sampled, vocab] fp32, sequence order of those with sample=True
    hidden: torch.Tensor  # [T, hc, D] final hc streams (input of the MTP head)


#: Parameters transformers keeps in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict).
FP32_PARTS = (
    "attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
    "kv_norm", "input_layernorm", "post_attention_layernorm", "norm.", "enorm", "hnorm",
)  # fmt: skip


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype`` except those the reference keeps in fp32 (those to fp32)."""
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if any(part in name for part in FP32_PARTS) else dtype)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating tensors created without a dtype are ``dtype`` inside (`torch.set_default_dtype`,
    process-wide). The model's fp32 parameters and buffers name their dtype, so building it
    under the serving dtype never holds an fp32 copy of the weights: at flash-shape widths a
    layer's experts are 13 GB in bf16 and 26 GB in fp32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: RunnerConfig,
        ep_group: object | None = None,
        placement: ExpertPlacement | None = None,
    ) -> None:
        """Load ``model_dir``; ``placement`` (default: identity over ``cfg.ep_size`` ranks) sets the
        initial physical expert slots of every MoE layer (EPLB replicas)."""
        model_cfg = ModelConfig.from_dir(model_dir)
        model = self._build(model_cfg, cfg, [placement], torch.device("cpu"))
        self.unused_keys = load_weights(model, model_dir, keep_quantized=cfg.keep_quantized)
        self._finish(model_cfg, cfg, model.to(device=cfg.device), ep_group)

    @classmethod
    def random(
        cls,
        model_cfg: ModelConfig,
        cfg: RunnerConfig,
        ep_group: object | None = None,
        placements: Sequence[ExpertPlacement | None] = (None,),
        seed: int = 0,
        fp8: bool = False,
    ) -> ModelRunner:
        """Seeded random weights built directly on ``cfg.device`` (`engine.checkpoint.random_init`):
        real widths without writing or reading a checkpoint. ``placements``: one for every MoE
        layer, or one for all. ``fp8``: then quantised and kept FP8 as an FP8 checkpoint's
        (`engine.model.qlinear.keep_fp8_`)."""
        self = cls.__new__(cls)
        with default_dtype(cfg.torch_dtype):  # every value is drawn below: none is lost
            model = self._build(model_cfg, cfg, placements, torch.device(cfg.device))
        randomize_(model, seed)
        if fp8:
            keep_fp8_(model)
        self.unused_keys = []
        self._finish(model_cfg, cfg, model, ep_group)
        return self

    @staticmethod
    def _build(
        model_cfg: ModelConfig,
        cfg: RunnerConfig,
        placements: Sequence[ExpertPlacement | None],
        device: torch.device,
    ) -> DeepseekV4:
        first = placements[0] or ExpertPlacement.identity(model_cfg.n_routed_experts, cfg.ep_size)
        with torch.device(device):
            model = DeepseekV4(model_cfg, first, cfg.ep_rank, with_mtp=cfg.with_mtp)
        moes = model.moe_layers()
        if len(placements) not in (1, len(moes)):
            raise ValueError(f"give one placement or one per MoE layer ({len(moes)}), not {len(placements)}")
        for moe, pl in zip(moes, placements if len(placements) > 1 else [first] * len(moes)):
            pl = pl or first
            if pl.ep_size != cfg.ep_size or pl.num_logical != model_cfg.n_routed_experts:
                raise ValueError("placement must cover the model's routed experts over cfg.ep_size ranks")
            moe.set_placement(pl)
        cast_parameters(model, cfg.torch_dtype)
        return model

    def _finish(self, model_cfg: ModelConfig, cfg: RunnerConfig, model: DeepseekV4, ep_group: object) -> None:
        self.forwards = 0  # forward passes run (EP lockstep counts them: engine.distributed.lockstep)
        self.split_steps = 0  # mixed steps run as two passes (`split`)
        self.cfg, self.model_cfg = cfg, model_cfg
        if cfg.batch_invariant and torch.device(cfg.device).type == "cuda":
            batch_invariant.enable()
        if cfg.fp8_compute == "w8a8":
            fp8.set_compute("w8a8")
        self.model = model.eval()
        dispatch = select_dispatch(ep_group, cfg.ep_size, torch.device(cfg.device))
        for moe in self.model.moe_layers():
            moe.dispatch = dispatch
        self.spec = CacheSpec.from_model(
            self.model_cfg, elem_bytes=cfg.torch_dtype.itemsize, state_bytes=cfg.torch_dtype.itemsize
        )
        # a graph cannot capture a host round trip: the MoE must take a grouped GEMM (bf16;
        # experts not quantised, or FP8 read by its kernel) and no expert-parallel all-to-all
        # (data-dependent sizes)
        capturable = (
            torch.device(cfg.device).type == "cuda" and cfg.ep_size == 1 and GROUPED_MM
            and cfg.torch_dtype == torch.bfloat16 and graph_safe(model)
        )  # fmt: skip
        graphs = cfg.decode_graphs == "padded" or (cfg.decode_graphs == "auto" and capturable)
        # padded decode rows need a block and a slot of their own, past the scheduler's
        spare = 1 if graphs else 0
        self.pool = CompressedPool(self.spec, cfg.num_blocks + spare, cfg.torch_dtype, cfg.device)
        self.swa = SWASlots(self.spec, cfg.num_slots + spare, cfg.torch_dtype, cfg.device)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(
                self.model, self.pool, self.swa, cfg.num_blocks, cfg.num_slots, cfg.device,
                capture=cfg.decode_graphs == "auto",
            )  # fmt: skip

    def check(self, batch: ForwardBatch) -> None:
        """Raise ValueError if the batch addresses slots or blocks this runner does not have."""
        bad_slots = [s for s in batch.swa_slot_cpu if not 0 <= s < self.cfg.num_slots]
        if bad_slots:
            raise ValueError(f"SWA slots {bad_slots} out of range [0, {self.cfg.num_slots})")
        table = batch.block_table if batch.block_table_cpu is None else batch.block_table_cpu
        top = int(table.max())
        if top >= self.cfg.num_blocks:
            raise ValueError(f"block id {top} out of range [0, {self.cfg.num_blocks})")

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> RunnerOutput:
        self.check(batch)
        self.forwards += 1
        for mtp in self.model.mtp:  # counted again by the step's drafting passes, if it drafts
            cast(DecoderLayer, mtp).mlp.last_load.zero_()
        parts = self.split(batch)
        if parts is None:
            return RunnerOutput(*self._forward(batch))
        self.split_steps += 1
        return self._forward_parts(batch, parts)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and graphable(batch):
            return self.graphs.run(batch)
        batch.write_fed(batch.input_ids)
        return self.model(batch, self.pool, self.swa)

    def split(self, batch: ForwardBatch) -> list[tuple[list[int], ForwardBatch, list[int]]] | None:
        """A mixed step as two passes: first its decode and verification rows (a decode graph,
        or the eager vectorised path), then the others (prompt chunks, replays, images); each
        part as (its sequences, its batch, the flat index in ``batch`` of each of its tokens).
        None: one pass.

        One pass over a step with a prompt chunk loops over every sequence of the step, so a
        decode row beside a prompt pays its share of that loop: on an H100 a step of 60 decodes
        beside one 256-token prompt took 356 ms in one pass, 30 ms in two (a graphed decode
        step: 3.7 ms); on a CPU core 60 decodes beside a 245-token prompt 262 ms in one pass,
        143 ms in two, but one decode beside it 100 ms against 112 (`sluice bench engine
        --mixed`: without graphs the second pass is a whole eager pass). Rows are independent
        (no attention across sequences; batch-invariant kernels make a row's result
        independent of its batch mates), so two passes compute what one would, and a decode
        row takes the decode path whatever shares its step. Expert-parallel steps run in one
        pass (EP lockstep pairs one pass a step across ranks)."""
        if not self.cfg.split_mixed_steps or self.cfg.ep_size > 1 or batch.num_seqs < 2:
            return None
        if self._vectorised(batch):
            return None
        logits = batch.num_logits_cpu or (1,) * batch.num_seqs
        keep = batch.swa_keep_cpu or ((0, 0),) * batch.num_seqs
        images = {at for at, _ in batch.embeds}
        decoding = [
            i
            for i, (q, m, start) in enumerate(zip(batch.query_len_cpu, logits, batch.query_start_cpu))
            if q == m <= MAX_GRAPH_QUERY  # a decode row, or a verification row
            and batch.sample_cpu[i] and not batch.cached_until[i] and not keep[i][0]
            and not images.intersection(range(start, start + q))
        ]  # fmt: skip
        if not decoding or len(decoding) == batch.num_seqs:
            return None
        part, flat = batch.select(decoding)
        if not self._vectorised(part):
            return None
        rest = [i for i in range(batch.num_seqs) if i not in set(decoding)]
        return [(decoding, part, flat), (rest, *batch.select(rest))]

    def _vectorised(self, batch: ForwardBatch) -> bool:
        """Whether one pass over ``batch`` runs without a per-sequence loop: as a decode graph
        where the runner has them, else on the eager decode or verification path."""
        if self.graphs is not None:
            return graphable(batch)
        return batch.is_decode or verify.applies(batch)

    def _forward_parts(
        self, batch: ForwardBatch, parts: list[tuple[list[int], ForwardBatch, list[int]]]
    ) -> RunnerOutput:
        """``batch`` computed as ``parts`` (`split`), one pass each: the results in ``batch``'s
        order, and the MoE layers' load counted over every pass."""
        counts = batch.num_logits_cpu or (1,) * batch.num_seqs
        row_of: dict[int, range] = {}  # sequence -> its logits rows among the parts' in turn
        token_at = [0] * batch.num_tokens  # flat token -> its row among the parts' in turn
        rows = tokens = 0
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        moes = self.model.moe_layers()
        load: list[torch.Tensor] = []  # each MoE layer's load over the passes before this one
        for n, (which, part, flat) in enumerate(parts):
            if n:  # a pass overwrites the counters: keep the earlier passes' count
                load = [moe.last_load.clone() for moe in moes]
            part_logits, part_hidden = self._forward(part)
            logits.append(part_logits)
            hidden.append(part_hidden)
            for moe, before in zip(moes, load):
                moe.last_load += before
            for i in which:
                if batch.sample_cpu[i]:
                    row_of[i] = range(rows, rows + counts[i])
                    rows += counts[i]
            for k, t in enumerate(flat):
                token_at[t] = tokens + k
            tokens += len(flat)
        order = [r for i in range(batch.num_seqs) for r in row_of.get(i, ())]
        index = upload(torch.tensor(order + token_at, dtype=torch.long), batch.input_ids.device)
        return RunnerOutput(torch.cat(logits)[index[: len(order)]], torch.cat(hidden)[index[len(order) :]])

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, depth: int = 0):
        """MTP draft logits for the token after ``next_ids`` (see `DeepseekV4.forward_mtp`)."""
        return self.model.forward_mtp(hidden, next_ids, batch, self.pool, self.swa, depth)

    def copy_slot(self, src: int, dst: int) -> None:
        self.swa.copy_slot(src, dst)

    def expert_load(self) -> torch.Tensor:
        return self.model.expert_load()
