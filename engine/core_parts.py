"""How an ``EngineConfig`` becomes the parts of an ``EngineCore`` (``engine/core.py``).

Each builder reads the config and, where it asks for something of the model, checks it
against the model this engine runs (a ``ValueError`` before anything is served).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.engine_config import COST_MODEL_FILE, EngineConfig
from engine.scheduler.config import INVARIANT_CHUNK_TOKENS, SchedulerConfig
from engine.scheduler.host_slots import HostSlotPool
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.kvconnector.slot_sharing import SlotSharing
    from engine.kvconnector.worker import KVWorker
    from engine.runner import ModelRunner
    from engine.spec.drafter import Drafter


def build_runner(cfg: EngineConfig, ep_group: Any = None, placement: Any = None) -> tuple[ModelRunner, str]:
    """The model runner (the checkpoint's weights, or seeded random ones) and the model
    fingerprint that names its cached blocks."""
    from engine.checkpoint.fingerprint import model_fingerprint
    from engine.kvconnector import payload as fmt
    from engine.runner import ModelRunner, RunnerConfig

    runner_cfg = RunnerConfig(
        num_blocks=cfg.num_blocks, num_slots=cfg.num_swa_slots, dtype=cfg.dtype, device=cfg.device,
        with_mtp=cfg.speculative is not None, ep_size=cfg.ep_size, ep_rank=cfg.ep_rank,
        decode_graphs=cfg.decode_graphs,
        batch_invariant=cfg.batch_invariant, keep_quantized=cfg.keep_quantized, fp8_compute=cfg.fp8_compute,
    )  # fmt: skip
    # quantised activations compute other caches: never shared with a w8a16 engine's
    w8a8 = "+w8a8" if cfg.fp8_compute == "w8a8" else ""
    if cfg.random_weights is None:
        runner = ModelRunner(cfg.model, runner_cfg, ep_group=ep_group, placement=placement)
        return runner, model_fingerprint(cfg.model, cfg.dtype + w8a8, fmt.LAYOUT_VERSION)
    from engine.checkpoint.fingerprint import random_weights_fingerprint
    from engine.config import ModelConfig

    runner = ModelRunner.random(
        ModelConfig.from_dir(cfg.model), runner_cfg, ep_group, [placement], seed=cfg.random_weights,
        fp8=cfg.keep_quantized,
    )  # fmt: skip
    fingerprint = random_weights_fingerprint(  # FP8-rounded weights are other weights
        cfg.model,
        cfg.random_weights,
        cfg.dtype + ("+fp8" if cfg.keep_quantized else "") + w8a8,
        fmt.LAYOUT_VERSION,
    )
    return runner, fingerprint


def open_store_client(cfg: EngineConfig) -> Any:
    """A client of the KV store that ``EngineConfig.kv_store`` describes."""
    from kvstore.spec import StoreSpec, open_store_client

    return open_store_client(StoreSpec.load(Path(cfg.kv_store or "")))


def host_slot_pool(cfg: EngineConfig, runner: ModelRunner) -> HostSlotPool | None:
    """The host pool that slots are saved to (``EngineConfig.host_swa_bytes``; else None)."""
    if not cfg.host_swa_bytes:
        return None
    return HostSlotPool(cfg.host_swa_bytes, cfg.host_swa_format, layers=_host_swa_layers(cfg, runner))


def _host_swa_layers(cfg: EngineConfig, runner: ModelRunner) -> int | None:
    """EngineConfig.host_swa_layers checked against the slot's layers (None: all kept)."""
    want, have = cfg.host_swa_layers, runner.swa.num_layers
    if want is not None and want > have:
        raise ValueError(f"host_swa_layers {want} exceeds the {have} layers of this model's SWA slot")
    return None if want == have else want


def spec_policy(cfg: EngineConfig, runner: ModelRunner) -> SpecPolicy | None:
    """Speculation's policy with its step profile, after checking the slot's rings can
    stage every draft (each staged position needs its own row)."""
    spec = cfg.spec
    if spec is None:
        return None
    swa = runner.swa
    rings = [t.shape[1] for t in swa.layer_rings(range(swa.num_layers))]
    if spec.num_drafts > min(rings):
        raise ValueError(
            f"{spec.num_drafts} drafts per step exceed the smallest SWA ring ({min(rings)} rows)"
        )
    if spec.profile_path:  # named: it must be there (a missing one is a misconfiguration)
        path = Path(spec.profile_path)
        if not path.is_file():
            raise ValueError(f"spec_profile_path {str(path)!r} is not a file (a step profile's JSON)")
    else:  # this machine's profile, if one was measured: a GPU's is named after its model
        from engine.spec.profiling import device_steps_file

        path = Path(cfg.model) / device_steps_file(cfg.device)
    profile = SpecProfile.load(path) if path.is_file() else None
    return SpecPolicy(spec, profile)


def drafter(cfg: EngineConfig, runner: ModelRunner, num_drafts: int) -> Drafter:
    """The MTP drafter of a speculating engine, with the model's confidence head if it has one
    (ValueError if that head reads draft positions and has fewer than ``num_drafts``)."""
    from engine.model.confidence import load_confidence_head
    from engine.spec.drafter import Drafter

    head = load_confidence_head(cfg.model, cfg.device)
    if head is not None and 0 < head.cfg.positions < num_drafts:
        raise ValueError(
            f"{cfg.model}'s confidence head knows draft positions 1..{head.cfg.positions}; "
            f"the engine drafts {num_drafts} (set the speculation's num_drafts <= {head.cfg.positions})"
        )
    return Drafter(runner.model, runner.pool, runner.swa, head, runner.graphs)


def scheduler_config(cfg: EngineConfig, mc: ModelConfig, save_new_blocks: bool) -> SchedulerConfig:
    """The scheduler's settings; ``save_new_blocks``: new full blocks go to a KV store."""
    from costmodel import CostModel

    path = Path(cfg.cost_model_path) if cfg.cost_model_path else Path(cfg.model) / COST_MODEL_FILE
    cost = CostModel.from_json(path.read_text()) if path.is_file() else None
    return SchedulerConfig(
        num_blocks=cfg.num_blocks,
        num_swa_slots=cfg.num_swa_slots,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        step_time_budget_s=cfg.step_time_budget_s,
        cost_model=cost,
        enable_prefix_caching=cfg.enable_prefix_caching,
        cache_event_capacity=cfg.cache_event_capacity,
        # A hit whose slot state is gone is replayed exactly: L * (W - 1) tokens rebuild the
        # window of every layer (docs/engine.md, docs/engine-runtime.md).
        swa_miss_policy="replay",
        swa_replay_tokens=mc.num_hidden_layers * (mc.sliding_window - 1),
        bounded_replay_tokens=mc.sliding_window - 1,
        bounded_replay=cfg.swa_replay == "bounded",
        save_new_blocks=save_new_blocks,
        batch_invariant=cfg.batch_invariant,
        invariant_chunk_tokens=min(INVARIANT_CHUNK_TOKENS, cfg.max_num_batched_tokens // 256 * 256),
    )


def slot_sharing(cfg: EngineConfig, host_slots: HostSlotPool | None, kv: KVWorker) -> SlotSharing | None:
    """This engine's part in sharing SWA slots with other engines (with
    ``EngineConfig.swa_directory`` and a host slot pool; else None)."""
    if cfg.swa_directory is None or host_slots is None:
        return None
    from engine.kvconnector.slot_sharing import SlotSharing  # gRPC: only when sharing

    return SlotSharing(
        host_slots, cfg.swa_directory, kv, cfg.swa_server_host, cfg.swa_lease_s, cfg.swa_fetch_timeout_s
    )
