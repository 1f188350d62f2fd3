"""Engine outputs -> recipe's StreamProcessor -> SSE events or one accumulated response.

Every response body, streamed or not, is produced by deepseek-recipe: engine token ids
and logprobs go in as ``InferenceChunk``s, protocol chunks come out (reasoning content,
tool calls, JSON output, stop sequences, usage with ``prompt_cache_hit_tokens``).
Non-streaming responses feed the same chunks to recipe's response accumulators.

When the processor finishes on its own (a stop sequence matched) or the consumer goes
away (client disconnect cancels the task), the engine generator is closed, which aborts
the request in the engine and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from services.api.completions import completion_json
from services.api.convert import RESPONSE_TYPES, Prepared
from services.api.engine_client import EngineClient, EngineOutput, EngineRequestError, EngineUnavailable
from services.api.errors import ApiError, anthropic_body, openai_body
from services.api.metrics import ApiMetrics

log = logging.getLogger(__name__)
_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    first_token_at: float | None = None
    bounded_replay: bool = False  # the engine rebuilt a prefix hit's window approximately


SETTLE_TIMEOUT_S = 10.0  # an engine client's cleanup (its abort) gets this long


async def _settle(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` once and wait for it to finish, even while our own task is cancelled
    repeatedly (the cancellation is re-raised after); give up after ``SETTLE_TIMEOUT_S``."""
    task.cancel()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    cancelled = False
    while not task.done() and time.monotonic() < deadline:
        try:
            await asyncio.wait({task}, timeout=deadline - time.monotonic())
        except asyncio.CancelledError:
            cancelled = True
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: the stream's own error is not this request's concern now
    if cancelled:
        raise asyncio.CancelledError


class Generation:
    """One request's run through the engine and recipe's processor."""

    def __init__(
        self,
        prep: Prepared,
        engine: EngineClient,
        tokenizer: dr.Tokenizer,
        metrics: ApiMetrics,
        endpoint: str,
        timeout_s: float,
    ) -> None:
        self.prep = prep
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.endpoint = endpoint
        self.usage = Usage()
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self._reasoning_end = prep.reasoning_end_id
        self._stream: AsyncGenerator[tuple[EngineOutput, list], None] | None = None
        self._first: list = []
        self.created = int(time.time())

    async def events(self) -> AsyncGenerator[tuple[EngineOutput, list], None]:
        """(engine output, the protocol chunks it produced), until the processor finishes."""
        sp = dr.StreamProcessor(self.prep.make_generator(), self.prep.parsing_options, self.tokenizer)
        want_lp = self.prep.engine_request.top_logprobs is not None
        ready = False
        try:
            outs_gen: AsyncGenerator[EngineOutput, None] = self.engine.generate(self.prep.engine_request)  # type: ignore[assignment]
            async with aclosing(outs_gen) as outs:
                while True:
                    out = await self._next(outs)
                    if out is None:
                        break
                    chunks = []
                    if not ready:
                        usage = dr.PromptUsage(
                            prompt_tokens=out.prompt_tokens, prompt_cache_hit_tokens=out.cached_tokens
                        )
                        chunks += sp.push(dr.InferenceChunk.ready(prompt_usage=usage))
                        ready = True
                    self._account(out)
                    ids, lps = self._visible(out, want_lp)
                    if ids:
                        chunks += sp.push(dr.InferenceChunk.tokens(ids, lps))
                    if not sp.finished and out.finish_reason is not None:
                        if out.finish_reason not in _FINISH:
                            raise EngineUnavailable(f"the engine ended the request ({out.finish_reason})")
                        chunks += sp.push(dr.InferenceChunk.finish(_FINISH[out.finish_reason]))
                        chunks += sp.finish()
                    yield out, chunks
                    if sp.finished:  # a stop sequence matched, or the engine finished
                        return
            raise EngineUnavailable("the engine stopped the stream without a finish reason")
        finally:
            if not sp.finished:
                sp.close()
            self._record()

    def _visible(self, out: EngineOutput, want_lp: bool) -> tuple[list[int], list | None]:
        """The output's tokens (and logprobs) without the hidden control tokens."""
        hidden = self.prep.hidden_ids
        keep = [i for i, t in enumerate(out.token_ids) if t not in hidden]
        ids = [out.token_ids[i] for i in keep]
        if not (want_lp and out.logprobs):
            return ids, None
        return ids, [(out.logprobs[i][0], list(out.logprobs[i][1])) for i in keep]

    async def _next(self, outs: AsyncIterator[EngineOutput]) -> EngineOutput | None:
        """The engine stream's next output (None at its end), within the request's deadline.

        The stream runs in a task of its own, cancelled at most once: a client gone mid-stream
        cancels this task again and again (anyio's cancel scopes re-deliver), and a cancellation
        landing in the engine client's cleanup would cut its abort short, leaving the request
        running on the engine. So on any exit but a result, the stream's task is cancelled
        once and its cleanup is waited for (``_settle``) before this one ends."""
        left = self.deadline - time.monotonic()
        task = asyncio.ensure_future(anext(outs))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(left, 0.001))
        except BaseException:
            await _settle(task)
            raise
        if not done:
            await _settle(task)
            raise ApiError(504, "generation exceeded the server's time limit", param="request_timeout_s")
        try:
            return task.result()
        except StopAsyncIteration:
            return None

    def _account(self, out: EngineOutput) -> None:
        u = self.usage
        u.prompt_tokens, u.cached_tokens, u.completion_tokens = (
            out.prompt_tokens,
            out.cached_tokens,
            out.completion_tokens,
        )
        u.bounded_replay = u.bounded_replay or out.bounded_replay
        for token in out.token_ids if self._reasoning_end is not None else ():
            if token == self._reasoning_end:
                self._reasoning_end = None
                break
            u.reasoning_tokens += 1
        if out.token_ids and u.first_token_at is None:
            u.first_token_at = time.monotonic()
            self.metrics.ttft.labels(endpoint=self.endpoint).observe(u.first_token_at - self.started)

    def _record(self) -> None:
        m, u = self.metrics, self.usage
        m.prompt_tokens.inc(u.prompt_tokens)
        m.cached_tokens.inc(u.cached_tokens)
        m.completion_tokens.inc(u.completion_tokens)

    async def full_json(self) -> str:
        """The whole non-streaming response body, accumulated by recipe."""
        rtype = RESPONSE_TYPES[self.prep.kind]
        resp = None
        async for out, chunks in self.events():
            if resp is None:
                resp = rtype(
                    self.prep.request_id, self.prep.model, self.created, out.prompt_tokens, out.cached_tokens
                )
            for chunk in chunks:
                resp.accumulate(chunk)
        if resp is None:
            raise EngineUnavailable("the engine returned no output")
        text = self._fix_usage(resp.to_json())
        return completion_json(text, chunk=False) if self.prep.kind == "completions" else text

    def _fix_usage(self, text: str) -> str:
        """Set the output token count to the engine's.

        recipe counts output tokens by the text they decode to, so byte-fallback tokens of
        an incomplete UTF-8 sequence held back at the end (common with random weights,
        possible with real ones at max_tokens) go uncounted; the client is billed for what
        the engine generated.
        """
        if '"usage"' not in text:
            return text
        obj = json.loads(text)
        _patch_usage(obj, self.usage)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    async def prime(self) -> None:
        """Start the stream and wait for its first output, so engine refusals raise here."""
        stream = self._stream = self.events()
        _, self._first = await anext(stream)

    async def sse(self) -> AsyncIterator[bytes]:
        """The streaming body (after ``prime``): recipe's chunks as SSE; an error mid-stream
        becomes an error event."""
        if self._stream is None:
            raise RuntimeError("Generation.sse() needs prime() first")
        rtype = RESPONSE_TYPES[self.prep.kind]
        try:
            for chunk in self._first:
                yield self._format(rtype, chunk)
            async for _, chunks in self._stream:
                for chunk in chunks:
                    yield self._format(rtype, chunk)
        except (EngineUnavailable, EngineRequestError, ApiError) as exc:
            yield self._error_event(exc)
            return
        except Exception:  # a bug or a recipe stream error: say so in-band, keep details in the log
            log.exception("stream %s failed", self.prep.request_id)
            yield self._error_event(ApiError(500, "internal error while streaming", code="internal_error"))
            return
        finally:
            await self._close_stream()  # the consumer left mid-stream: abort the engine request
            self.metrics.latency.labels(endpoint=self.endpoint).observe(time.monotonic() - self.started)
        done = rtype.sse_done_data()
        if done is not None:
            yield f"data: {done}\n\n".encode()

    async def _close_stream(self) -> None:
        """Close the stream (its generator aborts the engine request); if it cannot be closed
        (still running somewhere), abort the request directly. Shielded: this runs while the
        client's cancellation is being delivered."""
        assert self._stream is not None
        try:
            await asyncio.shield(self._stream.aclose())
        except RuntimeError:
            log.warning("stream %s could not be closed; aborting its request", self.prep.request_id)
            await asyncio.shield(self.engine.abort(self.prep.engine_request.request_id))

    def _format(self, rtype: type, chunk: object) -> bytes:
        data = self._fix_usage(chunk.to_json())  # type: ignore[attr-defined]
        if self.prep.kind == "completions":
            data = completion_json(data, chunk=True)
        name = rtype.sse_event_name(chunk)  # type: ignore[attr-defined]
        return (f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n").encode()

    def _error_event(self, exc: Exception) -> bytes:
        if isinstance(exc, ApiError):
            err = exc
        elif isinstance(exc, EngineRequestError):
            err = ApiError(400, str(exc))
        else:
            err = ApiError(503, str(exc), code="engine_unavailable")
        if self.prep.kind == "messages":
            return f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n".encode()
        body = openai_body(err)
        if self.prep.kind == "responses":  # Responses streams carry a typed error event
            inner = body["error"]
            event = {
                "type": "error",
                "code": inner["code"],
                "message": inner["message"],
                "param": inner["param"],
            }
            return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
        return f"data: {json.dumps(body)}\n\n".encode()


def _patch_usage(node: object, counts: Usage, depth: int = 0) -> None:
    """Every ``usage`` object below ``node``: output and reasoning counts := the engine's;
    ``"swa_replay": "bounded"`` when the engine served the prompt's prefix hit by a bounded
    (approximate) replay of its window state."""
    if depth > 4 or not isinstance(node, dict):
        return
    generated, reasoning = counts.completion_tokens, counts.reasoning_tokens
    usage = node.get("usage")
    if isinstance(usage, dict):
        if counts.bounded_replay:
            usage["swa_replay"] = "bounded"
        for out_key, in_key in (("completion_tokens", "prompt_tokens"), ("output_tokens", "input_tokens")):
            if out_key in usage:
                usage[out_key] = generated
                if "total_tokens" in usage and in_key in usage:
                    usage["total_tokens"] = usage[in_key] + generated
        for details in ("completion_tokens_details", "output_tokens_details"):
            if isinstance(usage.get(details), dict) and "reasoning_tokens" in usage[details]:
                usage[details]["reasoning_tokens"] = reasoning
    for value in node.values():
        if isinstance(value, dict):
            _patch_usage(value, counts, depth + 1)
