"""``EngineCore``: the one engine under every front end.

The offline ``LLM``, the API's ``InProcessEngineClient``, the routed replicas and the
Ray actors all wrap this class, so a request and a seed give the same tokens wherever
they run. Its surface is plain data: ``add(CoreRequest)``, ``abort``, ``step() ->
list[SeqOutput]``, ``stats() -> CoreStats``, ``drain_events``, and ``export_sequence`` /
``import_sequence`` (bytes). No live scheduler or model object crosses it.

It owns the scheduler, the model executor and the step loop (``engine/loop.py``), and
the KV connector (``engine/kvconnector/``): with a store, a request whose prefix is longer
in the store than in the local cache waits (``WAITING_FOR_REMOTE_KV``) while the blocks
are fetched, then finds them as local cache hits; every newly published block is
snapshotted after its step and written to the store off the step's path.

Not thread-safe: one thread drives it (``compile_grammar`` excepted, which may run on a
caller's worker thread).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from costmodel.online import DecodeStepSums
from engine.engine_config import COST_MODEL_FILE, EngineConfig
from engine.executor import ModelExecutor
from engine.kvconnector.connector import ConnectorConfig, PendingFetch, StoreConnector
from engine.kvconnector.transfer import export_sequence, import_sequence
from engine.kvconnector.worker import KVWorker
from engine.loop import EngineLoop
from engine.messages import CoreRequest, CoreStats, SeqOutput
from engine.sampling.params import SamplingParams, StructuredOutput, derive_seed
from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.config import INVARIANT_CHUNK_TOKENS, SchedulerConfig
from engine.scheduler.hashing import BlockHash, ExtraKeys
from engine.scheduler.host_slots import HostSlotPool
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler, StepUpdate
from engine.spec.costs import PLAIN, SPECULATING
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile
from engine.step_state import SamplingState

if TYPE_CHECKING:
    from engine.kvconnector.slot_sharing import SlotSharing
    from engine.spec.drafter import Drafter

__all__ = ["CoreRequest", "CoreStats", "EngineConfig", "EngineCore", "SeqOutput", "block_keys"]
_FETCH_POLL_S = 0.002  # how long an otherwise idle step waits for a store fetch


@dataclass
class _Track:
    prompt_tokens: int
    sent: int = 0


class EngineCore:
    """``store_client``: a store client to use instead of opening ``config.kv_store`` (an
    embedder sharing one client, or a test); ``connector``: the connector's settings;
    ``ep_group`` / ``placement``: the EP process group and the experts' physical placement
    of an engine that is one rank of an expert-parallel group."""

    def __init__(
        self,
        config: EngineConfig,
        store_client: Any = None,
        connector: ConnectorConfig | None = None,
        ep_group: Any = None,
        placement: Any = None,
    ) -> None:
        from engine.checkpoint.fingerprint import model_fingerprint
        from engine.kvconnector import payload as fmt
        from engine.runner import ModelRunner, RunnerConfig

        self.config = cfg = config
        runner_cfg = RunnerConfig(
            num_blocks=cfg.num_blocks, num_slots=cfg.num_swa_slots, dtype=cfg.dtype, device=cfg.device,
            with_mtp=cfg.speculative is not None, ep_size=cfg.ep_size, ep_rank=cfg.ep_rank,
            decode_graphs=cfg.decode_graphs,
            batch_invariant=cfg.batch_invariant, keep_quantized=cfg.keep_quantized, fp8_compute=cfg.fp8_compute,
        )  # fmt: skip
        # quantised activations compute other caches: never shared with a w8a16 engine's
        w8a8 = "+w8a8" if cfg.fp8_compute == "w8a8" else ""
        if cfg.random_weights is None:
            self.runner = ModelRunner(cfg.model, runner_cfg, ep_group=ep_group, placement=placement)
            self.fingerprint = model_fingerprint(cfg.model, cfg.dtype + w8a8, fmt.LAYOUT_VERSION)
        else:
            from engine.checkpoint.fingerprint import random_weights_fingerprint
            from engine.config import ModelConfig

            self.runner = ModelRunner.random(
                ModelConfig.from_dir(cfg.model), runner_cfg, ep_group, [placement], seed=cfg.random_weights,
                fp8=cfg.keep_quantized,
            )  # fmt: skip
            self.fingerprint = random_weights_fingerprint(  # FP8-rounded weights are other weights
                cfg.model,
                cfg.random_weights,
                cfg.dtype + ("+fp8" if cfg.keep_quantized else "") + w8a8,
                fmt.LAYOUT_VERSION,
            )
        mc = self.runner.model_cfg
        self.vocab_size = mc.vocab_size
        self.extra_keys = block_keys(self.fingerprint, cfg.device)
        dtype = self.runner.cfg.torch_dtype
        if store_client is None and cfg.kv_store:
            store_client = self._open_store_client()
        self.store = (
            StoreConnector(store_client, self._verify_block, connector) if store_client is not None else None
        )
        self.kv = KVWorker(
            bytes.fromhex(self.fingerprint), fmt.layout_digest(self.runner.spec, dtype), dtype, self.store
        )
        self.host_slots = (
            HostSlotPool(cfg.host_swa_bytes, cfg.host_swa_format, layers=self._host_swa_layers())
            if cfg.host_swa_bytes
            else None
        )
        self.spec = self._spec_policy()
        self.scheduler = Scheduler(self._scheduler_config(), self.host_slots, self.spec)
        self.executor = ModelExecutor(
            self.runner, cfg.device, self.kv, self.host_slots, self._drafter(),
            self.spec.config.num_drafts if self.spec is not None else 0,
        )  # fmt: skip
        # a speculating step's drafts and verified tokens are the next step's input: it
        # overlaps only steps that neither drafted nor verified (speculation off)
        self.loop = EngineLoop(
            self.scheduler, self.executor.execute, cfg.overlaps_steps,
            overlap_after=_drafts_nothing if self.spec is not None else None,
            launcher=self.executor if cfg.pipelines_steps else None, on_step=self._observe_step,
        )  # fmt: skip
        # the plain decode steps this engine runs, for the router's decode cost model
        # (costmodel.online): noted on the executing thread, summed on the driving one
        self.decode_steps = DecodeStepSums()
        self._decode_steps_extra = self.decode_steps.to_extra()  # replaced whole: read by stats()
        self._new_decode_steps: deque[tuple[int, int, float]] = deque(maxlen=4096)
        self._graph_captures = 0
        # a DSpark policy times the steps it chose against its profile (SpecPolicy.observe_seconds):
        # whole steps, as the profile times them, so not where steps overlap (asynchronous)
        self._times_spec_steps = (
            self.spec is not None
            and self.spec.adaptive
            and self.spec.config.measured_costs
            and not cfg.overlaps_steps
        )
        self._step_clean = True  # no executed step of this call ran anything but decoding
        self._tracks: dict[str, _Track] = {}
        self._out: list[SeqOutput] = []
        self._fetches: dict[str, PendingFetch] = {}
        self.slot_sharing: SlotSharing | None = None  # with EngineConfig.swa_directory
        if cfg.swa_directory is not None and self.host_slots is not None:
            from engine.kvconnector.slot_sharing import SlotSharing  # gRPC: only when sharing

            self.slot_sharing = SlotSharing(
                self.host_slots, cfg.swa_directory, self.kv, cfg.swa_server_host, cfg.swa_lease_s,
                cfg.swa_fetch_timeout_s,
            )  # fmt: skip
        self._slot_fetches: dict[str, Future[Any]] = {}  # request id -> a slot fetched from a peer
        self._grammar: Any = None
        self._grammar_lock = threading.Lock()
        self.eos_token_id = _eos(self.tokenizer_path)

    def _spec_policy(self) -> SpecPolicy | None:
        """Speculation's policy with its step profile, after checking the slot's rings can
        stage every draft (each staged position needs its own row)."""
        spec = self.config.spec
        if spec is None:
            return None
        swa = self.runner.swa
        rings = [t.shape[1] for t in swa.layer_rings(range(swa.num_layers))]
        if spec.num_drafts > min(rings):
            raise ValueError(
                f"{spec.num_drafts} drafts per step exceed the smallest SWA ring ({min(rings)} rows)"
            )
        if spec.profile_path:
            path = Path(spec.profile_path)
        else:  # this machine's profile: a GPU's is named after its model
            from engine.spec.profiling import device_steps_file

            path = Path(self.config.model) / device_steps_file(self.config.device)
        profile = SpecProfile.load(path) if path.is_file() else None
        return SpecPolicy(spec, profile)

    def _drafter(self) -> Drafter | None:
        if self.spec is None:
            return None
        from engine.model.confidence import load_confidence_head
        from engine.spec.drafter import Drafter

        head = load_confidence_head(self.config.model, self.config.device)
        return Drafter(self.runner.model, self.runner.pool, self.runner.swa, head, self.runner.graphs)

    def _host_swa_layers(self) -> int | None:
        """EngineConfig.host_swa_layers checked against the slot's layers (None: all kept)."""
        want, have = self.config.host_swa_layers, self.runner.swa.num_layers
        if want is not None and want > have:
            raise ValueError(f"host_swa_layers {want} exceeds the {have} layers of this model's SWA slot")
        return None if want == have else want

    def _open_store_client(self) -> Any:
        from kvstore.spec import StoreSpec, open_store_client

        return open_store_client(StoreSpec.load(Path(self.config.kv_store or "")))

    def _verify_block(self, payload: bytes) -> None:
        self.kv.verify_block(payload)

    def _scheduler_config(self) -> SchedulerConfig:
        from costmodel import CostModel

        cfg, mc = self.config, self.runner.model_cfg
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
            save_new_blocks=self.store is not None,
            batch_invariant=cfg.batch_invariant,
            invariant_chunk_tokens=min(INVARIANT_CHUNK_TOKENS, cfg.max_num_batched_tokens // 256 * 256),
        )

    # -- identity --------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.scheduler.config.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.config.num_blocks * self.block_size

    @property
    def tokenizer_path(self) -> Path:
        from engine.structured.tokenizer import deepseek_tokenizer_json

        if self.config.tokenizer_path:
            return Path(self.config.tokenizer_path)
        local = Path(self.config.model) / "tokenizer.json"
        return local if local.is_file() else deepseek_tokenizer_json()

    def compile_grammar(self, structured: StructuredOutput) -> Any:
        """A fresh ``GrammarState`` for one sequence; raises ``GrammarError``. Thread-safe."""
        from engine.structured.grammar import GrammarCompiler, GrammarConfig
        from engine.structured.matcher import GrammarState
        from engine.structured.tokenizer import ll_tokenizer

        with self._grammar_lock:
            ll_tok = ll_tokenizer(str(self.tokenizer_path), self.vocab_size)
            if self._grammar is None:
                limits = GrammarConfig(compile_timeout_s=self.config.grammar_compile_timeout_s)
                self._grammar = GrammarCompiler(ll_tok, limits)
            compiled = self._grammar.compile(structured)
            return GrammarState(compiled, ll_tok, self.vocab_size, self._grammar.limits())

    # -- requests --------------------------------------------------------------------------
    def check_prompt(self, prompt: tuple[int, ...] | list[int], max_tokens: int) -> None:
        """Raise ValueError if this engine cannot take the prompt (changes nothing)."""
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if not prompt or bad:
            raise ValueError(f"prompt is empty or has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) + max_tokens > self.capacity_tokens:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} exceeds the cache "
                f"({self.capacity_tokens} tokens = num_blocks x block size)"
            )

    def check_images(self, creq: CoreRequest) -> None:
        """Raise ValueError unless the request's images are spans of its prompt, in order and
        apart, each with one embedding row of the model's width per position."""
        end, hidden = 0, self.runner.model_cfg.hidden_size
        for i, img in enumerate(creq.images):
            if img.offset < end or img.offset + img.length > len(creq.prompt_token_ids):
                raise ValueError(
                    f"image {i}: span [{img.offset}, {img.offset + img.length}) overlaps the previous "
                    f"image or leaves the {len(creq.prompt_token_ids)}-token prompt"
                )
            shape = tuple(getattr(img.embeds, "shape", ()))
            if shape != (img.length, hidden):
                raise ValueError(f"image {i}: embeddings must be [{img.length}, {hidden}], got {list(shape)}")
            end = img.offset + img.length

    def resolve_seed(self, request_id: str, params: SamplingParams) -> int:
        """The request's own seed, or one derived from the engine seed and its id."""
        return (
            params.seed if params.seed is not None else derive_seed(self.config.seed, f"request:{request_id}")
        )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset({self.eos_token_id})
        return frozenset(params.stop_token_ids) | eos

    def add(self, creq: CoreRequest, grammar: Any = None) -> None:
        """Queue a request. Raises ValueError (nothing added) for a prompt, params or id the
        engine refuses, and ``GrammarError`` for a constraint it cannot compile."""
        params = creq.params
        if params.n != 1:
            raise ValueError("EngineCore takes one sequence per request (n=1); expand n with fork_of")
        self.check_prompt(creq.prompt_token_ids, params.max_tokens)
        self.check_images(creq)
        if grammar is None and params.structured is not None:
            grammar = self.compile_grammar(params.structured)
        seed = creq.seed if creq.seed is not None else self.resolve_seed(creq.request_id, params)
        stop_ids = self.stop_ids(params)
        self._settle(creq.request_id)
        req = Request(
            creq.request_id, list(creq.prompt_token_ids), params.max_tokens, stop_ids, creq.priority,
            self.extra_keys, fork_of=creq.fork_of, traffic_class=creq.traffic_class,
            swa_replay=creq.swa_replay, images=creq.images,
        )  # fmt: skip
        fetch = self._start_fetch(req)
        slot_fetch = self._start_slot_fetch(req)
        try:
            self.scheduler.add_request(req, remote_kv=fetch is not None or slot_fetch is not None)
        except ValueError:
            self.scheduler.cache.unpin(req)
            raise
        if fetch is not None:
            self._fetches[req.request_id] = fetch
        if slot_fetch is not None:
            self._slot_fetches[req.request_id] = slot_fetch
        self.executor.add(
            req.request_id, SamplingState(params, seed, list(req.prompt_token_ids), stop_ids, grammar=grammar)
        )
        self._tracks[req.request_id] = _Track(len(req.prompt_token_ids))

    def _start_fetch(self, req: Request) -> PendingFetch | None:
        """Scheduler side of the connector: after the local prefix match, ask the store for the
        rest of the prompt's full blocks (at least one token is always left to compute). The
        local run is pinned so that it is still there when the fetched blocks join it."""
        if self.store is None or req.fork_of or not self.config.enable_prefix_caching:
            return None
        usable = (len(req.prompt_token_ids) - 1) // self.block_size
        hashes = self.scheduler.cache.hasher_for(req).update(req.prompt_token_ids)[:usable]
        blocks = self.scheduler.cache.blocks
        local = blocks.lookup(hashes, count=False)
        if len(local) == len(hashes):
            return None
        blocks.acquire(local)
        req.pinned_blocks = list(local)
        return self.store.fetch(hashes[len(local) :])

    def _start_slot_fetch(self, req: Request) -> Future[Any] | None:
        """With slot sharing: fetch another engine's slot that the prompt extends further than
        any this engine holds (its blocks come from this engine's cache or the store fetch)."""
        if self.slot_sharing is None or req.fork_of or not self.config.enable_prefix_caching:
            return None
        tokens = req.prompt_token_ids
        hashes = self.scheduler.cache.hasher_for(req).update(tokens)[: (len(tokens) - 1) // self.block_size]
        return self.slot_sharing.start_fetch(tokens, hashes, self.block_size)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request (``reason`` "abort", or "stop" for a front end's stop string); its
        blocks and slot are freed. False if it is unknown or already finished."""
        self._fetches.pop(request_id, None)
        self._slot_fetches.pop(request_id, None)
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus(reason))
        track = self._tracks.pop(request_id, None)
        if track is not None:
            self._out.append(self._message(req, track, (), (), reason))
        return True

    # -- stepping --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._out) or self.loop.has_work()

    def will_forward(self) -> bool:
        """Whether ``step`` would run a forward pass now (EP lockstep asks before stepping)."""
        self._poll_fetches()
        return self.loop.has_work() and (not self.loop.idle or self.scheduler.has_ready())

    def housekeeping(self) -> list[SeqOutput]:
        """``step`` without a forward pass: store fetches and idle saves; the messages."""
        self._poll_fetches()
        if self.loop.idle:
            self._save_idle()
        return self.take_outputs()

    def step(self) -> list[SeqOutput]:
        """Run one step (if there is work) and return the messages produced since the last call."""
        self._poll_fetches()
        if self.loop.has_work() and (not self.loop.idle or self.scheduler.has_ready()):
            t0 = time.perf_counter()
            self._step_clean = True
            self._collect(self.loop.step())
            if self._times_spec_steps:
                assert self.spec is not None
                self.spec.observe_seconds(time.perf_counter() - t0, self._step_clean)
            self._sum_decode_steps()
        elif (self._fetches or self._slot_fetches) and not self._out:
            waiting = [f.future for f in self._fetches.values()] + list(self._slot_fetches.values())
            concurrent.futures.wait(waiting, _FETCH_POLL_S)
        if self.loop.idle:
            self._save_idle()
        return self.take_outputs()

    def _observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Note ``out`` if it is a plain decode step: every sequence computes one token and
        samples the next, nothing is drafted, and nothing but the forward pass and sampling
        ran in it (no cache loads, slot saves or fork copies, no CUDA graph captured).
        Its batch, the KV tokens it read (those in the caches before it, as the profiled
        step tables count them) and its seconds are what the decode cost model fits."""
        graphs = self.runner.graphs
        captures = graphs.captures if graphs is not None else 0
        captured, self._graph_captures = captures != self._graph_captures, captures
        moved = bool(out.kv_loads or out.slot_loads or out.slot_saves or out.block_copies or out.slot_copies)
        decoding = bool(out.seqs) and out.prompt_tokens == 0  # every row decodes or verifies
        # what the speculation policy's step timing may count (a pipelined step finishes in
        # the next call, so its verdict lands there; the steps either side of it are mostly
        # of its kind, and the policy takes a median over many)
        self._step_clean = self._step_clean and decoding and not captured and not moved
        if captured or not out.seqs or self.executor.draft_depth(out) > 0 or moved:
            return
        if any(s.num_new != 1 or s.num_drafts or not s.sample for s in out.seqs):
            return
        self._new_decode_steps.append((len(out.seqs), sum(s.start_pos for s in out.seqs), seconds))

    def _sum_decode_steps(self) -> None:
        if self._new_decode_steps:
            while self._new_decode_steps:
                self.decode_steps.add(*self._new_decode_steps.popleft())
            self._decode_steps_extra = self.decode_steps.to_extra()

    def take_outputs(self) -> list[SeqOutput]:
        out, self._out = self._out, []
        return out

    def _poll_fetches(self) -> None:
        for rid, fetch in list(self._fetches.items()):
            if not fetch.done():
                continue
            del self._fetches[rid]
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            payloads = fetch.result()
            blocks = self.scheduler.cache.blocks
            fresh = blocks.allocate(min(len(payloads), blocks.num_available))
            for block, h, payload in zip(fresh, fetch.hashes, payloads):
                if blocks.register(block, h):  # else another request published it meanwhile
                    self.scheduler.queue_kv_load(block, payload)
            req.pinned_blocks.extend(fresh)
            if rid not in self._slot_fetches:
                self.scheduler.remote_kv_ready(rid)
        for rid, future in list(self._slot_fetches.items()):  # the entry is in the pool already
            if not future.done():
                continue
            del self._slot_fetches[rid]
            req = self.scheduler.requests.get(rid)
            if (
                req is not None
                and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
                and rid not in self._fetches
            ):
                self.scheduler.remote_kv_ready(rid)

    def _save_idle(self) -> None:
        slots = self.scheduler.take_idle_host_saves()
        if slots:  # nothing in flight: copy the turns that just ended to the host pool now
            self.executor.save_slots(slots)
        saves = self.scheduler.take_idle_saves()
        if saves:
            self.kv.save(self.runner.pool, saves)
            self.scheduler.cache.blocks.release([b for b, _, _ in saves])

    def _collect(self, upd: StepUpdate) -> None:
        finished = {r.request_id: r for r in upd.finished}
        for rid in dict.fromkeys([*upd.new_tokens, *finished]):
            track = self._tracks.get(rid)
            req = finished.get(rid) or self.scheduler.requests.get(rid)
            if track is None or req is None:
                continue
            new = tuple(req.output_token_ids[track.sent :])
            lp = upd.logprobs.get(rid)
            if isinstance(lp, tuple):  # one per token of a step that accepted drafts
                lps = lp[: len(new)] + (None,) * (len(new) - len(lp))
            else:
                lps = (lp,) if len(new) == 1 else (None,) * len(new)
            reason = req.status.value if rid in finished else None
            if reason is not None:
                del self._tracks[rid]
            self._out.append(self._message(req, track, new, lps, reason))

    @staticmethod
    def _message(
        req: Request, track: _Track, new: tuple[int, ...], lps: tuple[Any, ...], reason: str | None
    ) -> SeqOutput:
        track.sent += len(new)
        outs = req.output_token_ids
        stop = outs[-1] if reason == "stop" and outs and outs[-1] in req.stop_token_ids else None
        error = req.error if reason == "error" else None
        return SeqOutput(
            req.request_id, new, lps, reason, stop, error, track.prompt_tokens, max(req.num_cached_tokens, 0),
            len(outs), bounded_replay=req.bounded_replays > 0,
        )  # fmt: skip

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> CoreStats:
        sched = self.scheduler
        blocks, slots = sched.cache.blocks, sched.cache.slots
        extra = {
            "free_swa_slots": float(slots.num_available),
            "total_swa_slots": float(slots.num_slots),
            "retained_swa_slots": float(slots.num_retained),
            # what requests hold (cached blocks and retained slots are reclaimable, not held)
            "held_blocks": float(blocks.num_blocks - blocks.num_available - slots.num_retained_partials),
            "held_swa_slots": float(slots.num_slots - slots.num_available),
            "preemptions": float(sched.num_preemptions),
            # the KV that waiting sequences will hold once admitted: owed, not yet held
            "waiting_tokens": float(sum(r.num_tokens for r in sched.waiting)),
            "waiting_for_remote_kv": float(len(self._fetches)),
            # a prefix hit's window state: adopted from a retained slot, or rebuilt by replay
            "swa_slot_hits_local": float(slots.reused),
            "swa_slot_hits_host": float(sched.cache.host_hits),
            **{f"swa_replays_{k}": float(v) for k, v in sched.cache.replays.items()},
            **{f"swa_replayed_tokens_{k}": float(v) for k, v in sched.cache.replayed_tokens.items()},
        }
        extra.update(self._decode_steps_extra)
        extra["split_steps"] = float(self.runner.split_steps)  # mixed steps run as two passes
        if self.spec is not None:
            extra.update(self.spec.stats.as_dict())
            if self._times_spec_steps:  # measured / profiled step times, per kind (SpecPolicy.costs)
                costs = self.spec.costs
                extra.update(
                    spec_cost_scale_plain=costs.scale(PLAIN), spec_cost_scale_speculating=costs.scale(SPECULATING),
                    spec_cost_steps_plain=float(costs.steps[PLAIN]),
                    spec_cost_steps_speculating=float(costs.steps[SPECULATING]),
                )  # fmt: skip
        graphs = self.runner.graphs
        if graphs is not None:  # CUDA graphs (or their padded batches, run eagerly)
            extra.update(
                graph_captures=float(graphs.captures), graph_replays=float(graphs.replays),
                graph_verify_steps=float(graphs.verify_steps),
            )  # fmt: skip
            drafter = self.executor.drafter
            if drafter is not None and drafter.graphs is not None:
                extra["graph_draft_chains"] = float(drafter.graphs.chains_run)
        if self.store is not None:
            extra.update(self.store.stats.as_dict())
        if self.slot_sharing is not None:
            extra.update(self.slot_sharing.stats())
        if self.host_slots is not None:
            host = self.host_slots
            extra.update(
                host_swa_slots=float(len(host)), host_swa_bytes=float(host.nbytes),
                host_swa_budget_bytes=float(host.budget_bytes), host_swa_saved=float(host.saved),
                host_swa_evicted=float(host.evicted),
            )  # fmt: skip
        return CoreStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            free_blocks=blocks.num_available,
            total_blocks=blocks.num_blocks,
            kv_tokens=sum(r.num_computed for r in sched.running),
            steps=self.loop.steps,
            extra=extra,
        )

    def records_events(self) -> bool:
        return self.scheduler.cache.blocks.events is not None

    def drain_events(self) -> CacheEventBatch:
        """Prefix-cache events (blocks stored / removed) since the last call."""
        events = self.scheduler.cache.blocks.events
        return events.drain() if events is not None else CacheEventBatch()

    def cached_hashes(self) -> list[BlockHash]:
        return self.scheduler.cache.blocks.cached_hashes()

    def take_store_events(self) -> list[BlockHash]:
        """Block hashes this engine saw in the KV store (written or fetched) since the last
        call, for a router's index; empty without a store. Thread-safe."""
        return self.store.take_stored() if self.store is not None else []

    # -- handoff ---------------------------------------------------------------------------
    def export_sequence(self, request_id: str) -> bytes:
        """Hand a running sequence over: its state as a versioned payload, after which it is
        gone from this engine (its blocks stay cached here). Steps in flight are applied
        first; their messages wait in ``take_outputs``. Raises KeyError / ValueError."""
        self._drain()
        payload = export_sequence(self, request_id)
        self._tracks.pop(request_id, None)
        return payload

    def _settle(self, request_id: str) -> None:
        """Apply the steps in flight if one of them still computes ``request_id`` (finished or
        aborted meanwhile): a request reusing the id must not receive their tokens."""
        if self.loop.in_flight(request_id):
            self._drain()

    def _drain(self) -> None:
        """Apply every step in flight; their messages wait in ``take_outputs``."""
        for upd in self.loop.drain():
            self._collect(upd)

    def import_sequence(self, payload: bytes) -> str:
        """Continue a sequence exported by an engine of the same model, layout and dtype;
        returns its request id. Raises ``PayloadError`` (a ValueError) for a payload it must
        not use and ``EngineFull`` when it has no room now; either way nothing changed."""
        self._drain()  # the payload's id may be one a step in flight computes
        req, sent = import_sequence(self, payload)
        self._tracks[req.request_id] = _Track(len(req.prompt_token_ids), sent=sent)
        return req.request_id

    def store_usable(self, timeout_s: float = 1.0) -> bool:
        """Whether this engine's KV store can serve a read now: enough nodes answer their
        health check within ``timeout_s`` to decode a block (k of them). False without a
        store. Safe from another thread (it touches only the store client)."""
        if self.store is None:
            return False
        client = self.store.client
        serving = client.health_check(timeout_s)
        return sum(serving.values()) >= client.config.codec.k

    def close(self) -> None:
        self.loop.close()
        # captured graphs freed now, not by the cycle collector inside a later engine's step
        if self.runner.graphs is not None:
            self.runner.graphs.release()
        drafter = self.executor.drafter
        if drafter is not None and drafter.graphs is not None:
            drafter.graphs.release()
        if self.slot_sharing is not None:
            self.slot_sharing.close()  # withdraws this engine's slots from the directory
            self.slot_sharing = None
        if self._grammar is not None:
            self._grammar.close()
        if self.store is not None:
            self.store.close()


def block_keys(fingerprint: str, device: str) -> ExtraKeys:
    """What besides token ids names an engine's cached blocks: the model fingerprint and the
    kind of device (``cpu``, ``cuda``). KV computed on another kind of device differs in its
    last bits, and a hit must never change output, so the two never share blocks."""
    return ExtraKeys(model_id=f"{fingerprint}@{device.split(':')[0]}")


def _eos(tokenizer_json: Path) -> int:
    from engine.structured.tokenizer import eos_token_id

    return eos_token_id(tokenizer_json)


def _drafts_nothing(out: SchedulerOutput) -> bool:
    """A step that drafted nothing for the next and verified no drafts: the next step can be
    scheduled before its result is in."""
    return out.draft_depth == 0 and not any(s.num_drafts for s in out.seqs)
