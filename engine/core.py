"""``EngineCore``: the one engine under every front end.

The offline ``LLM``, the API's ``InProcessEngineClient``, the routed replicas and the
Ray actors all wrap this class, so a request and a seed give the same tokens wherever
they run. Its surface is plain data: ``add(CoreRequest)``, ``abort``, ``step() ->
list[SeqOutput]``, ``stats() -> CoreStats``, ``drain_events``, and ``export_sequence`` /
``import_sequence`` (bytes). No live scheduler or model object crosses it.

It owns the scheduler, the model executor and the step loop (``engine/loop.py``), and
the KV connector (``engine/kvconnector/``): with a store, a request whose prefix is longer
in the store than in the local cache waits (``WAITING_FOR_REMOTE_KV``) while the blocks
are fetched (``engine/kvconnector/fetches.py``), then finds them as local cache hits; every
newly published block is snapshotted after its step and written to the store off the step's
path. Beneath it: ``engine/core_parts.py`` builds the parts from the config,
``engine/outputs.py`` turns each step's update into messages, and
``engine/step_observer.py`` gives the executed steps to the cost models.

Not thread-safe: one thread drives it (``compile_grammar`` excepted, which may run on a
caller's worker thread).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import core_parts as parts
from engine.engine_config import EngineConfig
from engine.executor import ModelExecutor
from engine.kvconnector.connector import ConnectorConfig, StoreConnector
from engine.kvconnector.fetches import PrefixFetches
from engine.kvconnector.transfer import export_sequence, import_sequence
from engine.kvconnector.worker import KVWorker
from engine.loop import EngineLoop
from engine.messages import CoreRequest, CoreStats, SeqOutput
from engine.outputs import Outputs
from engine.sampling.params import SamplingParams, StructuredOutput, derive_seed
from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import BlockHash, ExtraKeys
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler
from engine.step_observer import StepObserver
from engine.step_state import SamplingState

if TYPE_CHECKING:
    from costmodel.online import DecodeStepSums
    from engine.kvconnector.slot_sharing import SlotSharing

__all__ = ["CoreRequest", "CoreStats", "EngineConfig", "EngineCore", "SeqOutput", "block_keys"]
_FETCH_POLL_S = 0.002  # how long an otherwise idle step waits for a store fetch


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
        from engine.kvconnector import payload as fmt

        self.config = cfg = config
        self.runner, self.fingerprint = parts.build_runner(cfg, ep_group, placement)
        mc = self.runner.model_cfg
        self.vocab_size = mc.vocab_size
        self.extra_keys = block_keys(self.fingerprint, cfg.device)
        dtype = self.runner.cfg.torch_dtype
        if store_client is None and cfg.kv_store:
            store_client = parts.open_store_client(cfg)
        self.store = (
            StoreConnector(store_client, self._verify_block, connector) if store_client is not None else None
        )
        self.kv = KVWorker(
            bytes.fromhex(self.fingerprint), fmt.layout_digest(self.runner.spec, dtype), dtype, self.store
        )
        self.host_slots = parts.host_slot_pool(cfg, self.runner)
        self.spec = parts.spec_policy(cfg, self.runner)
        sched_cfg = parts.scheduler_config(cfg, mc, save_new_blocks=self.store is not None)
        self.scheduler = Scheduler(sched_cfg, self.host_slots, self.spec)
        self.executor = ModelExecutor(
            self.runner, cfg.device, self.kv, self.host_slots,
            parts.drafter(cfg, self.runner, self.spec.config.num_drafts) if self.spec is not None else None,
            self.spec.config.num_drafts if self.spec is not None else 0,
        )  # fmt: skip
        drafter = self.executor.drafter
        if cfg.ep_size > 1 and drafter is not None:  # the ranks' MTP passes differ: matched
            from engine.distributed.lockstep import DraftLockstep

            self.executor.speculation.lockstep = DraftLockstep(self.runner, drafter.layer.mlp, ep_group)
        self.observer = StepObserver(self.runner, self.spec, cfg.overlaps_steps)
        # a speculating step's drafts and verified tokens are the next step's input: it
        # overlaps only steps that neither drafted nor verified (speculation off)
        self.loop = EngineLoop(
            self.scheduler, self.executor.execute, cfg.overlaps_steps,
            overlap_after=_drafts_nothing if self.spec is not None else None,
            launcher=self.executor if cfg.pipelines_steps else None, on_step=self.observer.observe,
        )  # fmt: skip
        self.outputs = Outputs(self.scheduler)
        sharing = parts.slot_sharing(cfg, self.host_slots, self.kv)
        self.fetches = PrefixFetches(self.scheduler, self.store, sharing)
        self._grammar: Any = None
        self._grammar_lock = threading.Lock()
        self.eos_token_id = _eos(self.tokenizer_path)

    def _verify_block(self, payload: bytes) -> None:
        self.kv.verify_block(payload)

    # -- identity --------------------------------------------------------------------------
    @property
    def slot_sharing(self) -> SlotSharing | None:
        """Sharing SWA slots with other engines (EngineConfig.swa_directory); None once closed."""
        return self.fetches.slot_sharing

    @property
    def decode_steps(self) -> DecodeStepSums:
        """The decode steps this engine ran (`StepObserver.observe`), summed for the router's
        decode cost model."""
        return self.observer.decode_steps

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
        fetch, slot_fetch = self.fetches.start(req)
        try:
            self.scheduler.add_request(req, remote_kv=fetch is not None or slot_fetch is not None)
        except ValueError:
            self.scheduler.cache.unpin(req)
            raise
        self.fetches.add(req.request_id, fetch, slot_fetch)
        self.executor.add(
            req.request_id, SamplingState(params, seed, list(req.prompt_token_ids), stop_ids, grammar=grammar)
        )
        self.outputs.track(req.request_id, len(req.prompt_token_ids))

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request (``reason`` "abort", or "stop" for a front end's stop string); its
        blocks and slot are freed. False if it is unknown or already finished."""
        self.fetches.drop(request_id)
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus(reason))
        self.outputs.end(req, reason)
        return True

    # -- stepping --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.outputs.pending or self.loop.has_work()

    def will_forward(self) -> bool:
        """Whether ``step`` would run a forward pass now (EP lockstep asks before stepping)."""
        self.fetches.poll()
        return self.loop.has_work() and (not self.loop.idle or self.scheduler.has_ready())

    def housekeeping(self) -> list[SeqOutput]:
        """``step`` without a forward pass: store fetches and idle saves; the messages."""
        self.fetches.poll()
        if self.loop.idle:
            self._save_idle()
        return self.take_outputs()

    def step(self) -> list[SeqOutput]:
        """Run one step (if there is work) and return the messages produced since the last call."""
        self.fetches.poll()
        if self.loop.has_work() and (not self.loop.idle or self.scheduler.has_ready()):
            self.observer.start()
            self.outputs.collect(self.loop.step())
            self.observer.finish()
        elif self.fetches.pending and not self.outputs.pending:
            self.fetches.wait(_FETCH_POLL_S)
        if self.loop.idle:
            self._save_idle()
        return self.take_outputs()

    def take_outputs(self) -> list[SeqOutput]:
        return self.outputs.take()

    def _save_idle(self) -> None:
        slots = self.scheduler.take_idle_host_saves()
        if slots:  # nothing in flight: copy the turns that just ended to the host pool now
            self.executor.save_slots(slots)
        saves = self.scheduler.take_idle_saves()
        if saves:
            self.kv.save(self.runner.pool, saves)
            self.scheduler.cache.blocks.release([b for b, _, _ in saves])

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
            "waiting_for_remote_kv": float(self.fetches.num_store_fetches),
            # a prefix hit's window state: adopted from a retained slot, or rebuilt by replay
            "swa_slot_hits_local": float(slots.reused),
            "swa_slot_hits_host": float(sched.cache.host_hits),
            **{f"swa_replays_{k}": float(v) for k, v in sched.cache.replays.items()},
            **{f"swa_replayed_tokens_{k}": float(v) for k, v in sched.cache.replayed_tokens.items()},
        }
        extra.update(self.observer.decode_steps_extra)
        extra["split_steps"] = float(self.runner.split_steps)  # mixed steps run as two passes
        if self.spec is not None:
            extra.update(self.spec.stats.as_dict())
            extra.update(self.observer.spec_cost_stats())
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
        self.outputs.forget(request_id)
        return payload

    def _settle(self, request_id: str) -> None:
        """Apply the steps in flight if one of them still computes ``request_id`` (finished or
        aborted meanwhile): a request reusing the id must not receive their tokens."""
        if self.loop.in_flight(request_id):
            self._drain()

    def _drain(self) -> None:
        """Apply every step in flight; their messages wait in ``take_outputs``."""
        for upd in self.loop.drain():
            self.outputs.collect(upd)

    def import_sequence(self, payload: bytes) -> str:
        """Continue a sequence exported by an engine of the same model, layout and dtype;
        returns its request id. Raises ``PayloadError`` (a ValueError) for a payload it must
        not use and ``EngineFull`` when it has no room now; either way nothing changed."""
        self._drain()  # the payload's id may be one a step in flight computes
        req, sent = import_sequence(self, payload)
        self.outputs.track(req.request_id, len(req.prompt_token_ids), sent=sent)
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
        self.fetches.close()  # withdraws this engine's slots from the directory
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
