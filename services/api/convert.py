"""Protocol request -> (recipe conversation, prompt token ids, EngineRequest), via deepseek-recipe.

Chat Completions, Responses and Messages are converted by recipe (``*Request(body)``,
``.model`` read first, ``.convert(options)``) and rendered with the V4.1 prompt encoding;
their streams are produced by recipe's ``StreamProcessor``. Legacy Completions has no
recipe type: its raw prompt is tokenised as is (BOS prepended) and its output runs
through a Chat Completions processor with thinking and tool parsing off, whose chunks
``completions.py`` rewrites into ``text_completion`` objects.

Model names: the served model id (the checkpoint directory name) plus ``model_aliases``
are registered as recipe aliases of ``DeepSeek-V4.1-Flash``; names in
``non_thinking_aliases`` (``deepseek-chat``) default to non-thinking mode, as on
DeepSeek's API. Any other name is refused by recipe with the list of accepted names.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import deepseek_recipe as dr

from engine.structured.tokenizer import control_tokens
from services.api.config import ApiConfig
from services.api.engine_client import EngineRequest, ModelInfo, StructuredSpec
from services.api.errors import ApiError, from_recipe, limit_error
from services.api.image_cache import PreprocessCache
from services.api.image_lift import lift_images
from services.api.images import ImageIntake, resolve_images
from services.api.limits import image_limits
from services.api.tool_grammar import tool_call_grammar
from services.api.traffic_class import DEFAULT_TRAFFIC_CLASS

Kind = Literal["chat", "completions", "responses", "messages"]

_REQUEST_TYPES: dict[str, Any] = {
    "chat": dr.ChatCompletionRequest,
    "responses": dr.ResponsesRequest,
    "messages": dr.MessagesRequest,
}
RESPONSE_TYPES: dict[str, Any] = {
    "chat": dr.ChatCompletionResponse,
    "completions": dr.ChatCompletionResponse,
    "responses": dr.ResponsesResponse,
    "messages": dr.MessagesResponse,
}
_ID_PREFIX = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp", "messages": "msg"}


@dataclass
class Prepared:
    """A converted request, ready for the engine and for recipe's stream processor."""

    kind: Kind
    request_id: str
    model: str
    stream: bool
    prompt_ids: list[int]
    engine_request: EngineRequest
    make_generator: Callable[[], Any]  # a fresh recipe chunk generator (consumed by StreamProcessor)
    parsing_options: dr.ParsingOptions
    reasoning_end_id: int | None = None  # output starts in reasoning, which ends at this token
    # Control tokens kept out of the text (see ``Converter.hidden_ids``); empty when the client
    # sent ``skip_special_tokens: false``.
    hidden_ids: frozenset[int] = frozenset()
    # recipe's preprocessed images and their V4.1 token counts, in placeholder order (None:
    # no images). Not sent to the engine yet: the prompt keeps one placeholder per image.
    images: ImageIntake | None = None


def is_tool_call_markup(spelling: str) -> bool:
    """DSML, the V4.1 tool-call syntax recipe's parser reads."""
    return dr.SpecialToken.Dsml.default_str() in spelling or "dsml:" in spelling.lower()


class Converter:
    """Holds the tokenizer, the prompt encoding and one ConversionOptions per thinking default."""

    def __init__(self, cfg: ApiConfig, info: ModelInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.tokenizer = dr.Tokenizer.from_file(info.tokenizer_path)
        self.encoding = dr.DeepseekV41Encoding().with_tokenizer(self.tokenizer)
        # The whole table is replaced (recipe's default also accepts DeepSeek-V4-Pro, which
        # would select the V4 encoding; this server renders V4.1 only).
        table = {name: dr.ModelVersion.DeepseekV41Flash for name in cfg.model_names}
        base = dr.ConversionOptions().with_model_versions_by_name(table)
        base = base.with_thinking_max_tokens_upper_bound(cfg.max_tokens_limit)
        base = base.with_non_thinking_max_tokens_upper_bound(cfg.max_tokens_limit)
        self.options_thinking = base
        self.options_plain = base.with_default_thinking_mode(False)
        self.bos_id = self._special_id(dr.SpecialToken.Bos)
        self.image_id = self._special_id(dr.SpecialToken.Image)
        self.image_cache = PreprocessCache(cfg.image_cache_bytes) if cfg.image_cache_bytes else None
        self.think_end_id = self._special_id(dr.SpecialToken.ThinkingEnd)
        controls = control_tokens(info.tokenizer_path)
        self.control_ids = frozenset(controls.values())
        thinking = (dr.SpecialToken.ThinkingStart.default_str(), dr.SpecialToken.ThinkingEnd.default_str())
        self.thinking_ids = frozenset(controls[s] for s in thinking if s in controls)
        self.tool_call_ids = frozenset(i for s, i in controls.items() if is_tool_call_markup(s))

    def hidden_ids(self, body: dict[str, Any], options: dr.ParsingOptions | None = None) -> frozenset[int]:
        """Control tokens kept out of this request's text: all of them, except those recipe's
        parser reads for it (the thinking delimiters when it thinks, the DSML markup when it
        parses tool calls), unless the client set ``skip_special_tokens`` (vLLM's extension)
        to false. A model emits the others only by mistake (random weights do all the time);
        they are dropped before the stream processor, and still counted in usage."""
        skip = body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise ApiError(400, "skip_special_tokens must be a boolean", param="skip_special_tokens")
        if not skip:
            return frozenset()
        keep: frozenset[int] = frozenset()
        if options is not None and options.thinking_initial_stage is not None:
            keep |= self.thinking_ids
        if options is not None and options.parse_tool_calls:
            keep |= self.tool_call_ids
        return self.control_ids - keep

    def _special_id(self, token: dr.SpecialToken) -> int:
        ids = self.tokenizer.encode(token.default_str())
        if len(ids) != 1:
            raise ValueError(
                f"tokenizer {self.info.tokenizer_path} lacks the special token {token.default_str()!r}"
            )
        return int(ids[0])

    def options_for(self, model: str) -> dr.ConversionOptions:
        return self.options_plain if model in self.cfg.non_thinking_aliases else self.options_thinking

    def prepare(
        self, kind: Kind, raw: bytes, body: dict[str, Any], traffic_class: str = DEFAULT_TRAFFIC_CLASS
    ) -> Prepared:
        if kind == "completions":
            from services.api.completions import prepare_completion

            return prepare_completion(self, raw, body, traffic_class)
        # base64 images go to recipe as stand-ins (see ``lift_images``): it only passes them through
        lifted = lift_images(body) if b";base64," in raw else None
        try:
            req = _REQUEST_TYPES[kind](raw if lifted is None else lifted.body)
        except ValueError as exc:  # recipe's serde errors: wrong types, overflows, missing fields
            raise ApiError(400, str(exc), param=_serde_param(str(exc))) from None
        model = req.model
        try:
            echo = req.echo() if kind == "responses" else None
            ns_map = req.namespace_tool_map(self.options_for(model)) if kind == "responses" else None
            conv = req.convert(self.options_for(model))
        except dr.ConversionError as exc:
            raise from_recipe(exc.status_code, exc.body) from None
        images = self.resolve_images(conv, lifted.originals if lifted is not None else None)
        try:
            prompt_ids = self.encoding.encode(conv.conversation)
        except RuntimeError as exc:
            raise ApiError(400, f"cannot encode the prompt: {exc}", param="messages") from None
        parts: tuple[Any, ...] = ()
        if images is not None:
            prompt_ids, parts = self.expand_images(prompt_ids, images)
        rid = f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}"
        max_tokens = self.resolve_max_tokens(conv, len(prompt_ids))
        engine_req = self.engine_request(
            rid, prompt_ids, max_tokens, conv, _single_tool_call(body), traffic_class=traffic_class,
            swa_replay=body.get("swa_replay"),
        )  # fmt: skip
        if parts:
            engine_req = dataclasses.replace(engine_req, images=parts)
        gen_type = _REQUEST_TYPES[kind]

        def make_generator() -> Any:
            gen = gen_type.chunk_generator(conv, rid, model)
            if ns_map:
                gen = gen.with_namespace_tool_map(ns_map)
            if echo is not None:
                gen = gen.with_echo(echo)
            return gen

        stage = conv.parsing_options.thinking_initial_stage
        end_id = self.think_end_id if stage is not None and stage.starts_in_reasoning() else None
        return Prepared(
            kind,
            rid,
            model,
            conv.stream,
            prompt_ids,
            engine_req,
            make_generator,
            conv.parsing_options,
            end_id,
            self.hidden_ids(body, conv.parsing_options),
            images,
        )

    def resolve_images(
        self, conv: dr.ConversationRequest, originals: dict[str, str] | None = None
    ) -> ImageIntake | None:
        """recipe's resolver over the image sources, in the order of their placeholders
        (``originals``: the client's data URLs behind a lifted request's stand-ins)."""
        if not any(m.image_sources for m in conv.conversation.messages):
            return None
        sources = self.encoding.render_conversation(conv.conversation).image_sources
        return resolve_images(list(sources), image_limits(self.cfg), self.image_cache, originals)

    def expand_images(self, prompt_ids: list[int], images: ImageIntake) -> tuple[list[int], tuple[Any, ...]]:
        """Each image's one placeholder becomes its V4.1 token count of placeholders (positions,
        the block chain, usage and the context check all see the expanded prompt); the spans
        and the recipe's preprocessed images go to the engine client, which encodes them."""
        from engine.vision.stage import expand_placeholders

        if not self.info.vision:
            raise ApiError(
                400, f"model {self.info.model_id!r} has no vision encoder: send text only", param="messages"
            )
        pairs = [(info, img.tokens) for img, info in zip(images.images, images.data.images)]
        try:
            return expand_placeholders(prompt_ids, self.image_id, pairs)
        except ValueError as exc:  # recipe renders one placeholder per image: a bug of ours
            raise ApiError(500, str(exc)) from None

    def resolve_max_tokens(self, conv: dr.ConversationRequest, prompt_tokens: int) -> int:
        limit = self.cfg.context_limit
        requested = conv.inference_options.max_tokens
        self.check_context(prompt_tokens, requested)
        if requested is None:
            return max(1, min(self.cfg.default_max_tokens, limit - prompt_tokens))
        return int(conv.resolve_max_tokens(prompt_tokens, limit))

    def check_context(self, prompt_tokens: int, requested: int | None) -> None:
        limit = self.cfg.context_limit
        if prompt_tokens >= limit or (requested is not None and prompt_tokens + requested > limit):
            extra = f" + max_tokens {requested}" if requested is not None else ""
            raise limit_error(
                "context_limit",
                f"prompt of {prompt_tokens} tokens{extra} exceeds the context of {limit} tokens",
            )

    def engine_request(
        self,
        rid: str,
        prompt_ids: list[int],
        max_tokens: int,
        conv: dr.ConversationRequest,
        single_tool_call: bool = False,
        *,
        traffic_class: str = DEFAULT_TRAFFIC_CLASS,
        swa_replay: str | None = None,
    ) -> EngineRequest:
        io = conv.inference_options
        top = (io.top_logprobs or 0) if io.logprobs else None
        temperature = 1.0 if io.temperature is None else float(io.temperature)
        top_p = 1.0 if io.top_p is None else float(io.top_p)
        return EngineRequest(
            request_id=rid,
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p if top_p > 0 else 1.0,
            seed=io.seed,
            top_logprobs=top,
            structured=self.structured(io.output_constraint, conv, single_tool_call),
            traffic_class=traffic_class,
            swa_replay=swa_replay,
        )

    def structured(
        self, oc: dr.OutputConstraint | None, conv: dr.ConversationRequest, single_tool_call: bool = False
    ) -> StructuredSpec | None:
        if oc is None:
            return None
        thinking = conv.parsing_options.thinking_initial_stage is not None
        think_end = self.think_end_id
        if oc.kind == "json":
            schema = oc.schema or '{"type": "object"}'  # json_object: an object, as the protocol names it
            if not thinking:
                return StructuredSpec("json_schema", schema)
            return StructuredSpec("grammar", _after_reasoning(think_end, f"%json {schema}"))
        if oc.kind == "regex":
            body = "/" + oc.schema.replace("/", "\\/") + "/"
            if not thinking:
                return StructuredSpec("regex", oc.schema)
            return StructuredSpec("grammar", _after_reasoning(think_end, body))
        if oc.kind == "tool_call_required":
            return StructuredSpec(
                "grammar", tool_call_grammar(json.loads(oc.schema), opened=True, single=single_tool_call)
            )
        return None  # tool_call (auto): the model chooses; recipe parses whatever it writes


def _after_reasoning(think_end_id: int, answer: str) -> str:
    """Lark: free reasoning text, the thinking-end token (by id), then the constrained answer."""
    return f"start: REASONING <[{think_end_id}]> answer\nanswer: {answer}\nREASONING: /(?s:.*)/\n"


def _single_tool_call(body: dict[str, Any]) -> bool:
    """``parallel_tool_calls: false`` (OpenAI) or ``disable_parallel_tool_use`` (Anthropic)."""
    choice = body.get("tool_choice")
    anthropic_single = isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True
    return body.get("parallel_tool_calls") is False or anthropic_single


def _serde_param(message: str) -> str | None:
    """recipe's serde messages name the field only sometimes: ``missing field `model```."""
    if "missing field `" in message:
        return message.split("missing field `", 1)[1].split("`", 1)[0]
    return None
