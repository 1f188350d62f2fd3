"""Grammar compilation for structured output (llguidance), with a cache and limits.

A request's constraint (JSON schema, regex or Lark-style EBNF) is checked and compiled
*before* the request is admitted; a bad one raises ``GrammarError`` naming the problem and
never reaches the engine loop (an invalid schema must not kill the engine,
CVE-2025-48942). Compiled grammars are cached by (kind, canonical text); each compilation
runs under a wall-clock limit and llguidance's own resource limits (grammar size, lexer
fuel, parser items), which also bound per-token mask work.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from engine.sampling.params import StructuredOutput


class GrammarError(ValueError):
    """The request's grammar is invalid, too large or too slow to compile; says why."""


@dataclass(frozen=True)
class GrammarConfig:
    max_source_bytes: int = 64 * 1024
    compile_timeout_s: float = 2.0
    cache_size: int = 256
    max_grammar_size: int = 500_000  # llguidance: grammar symbols after expansion
    step_lexer_fuel: int = 1_000_000  # llguidance: per-token lexer work bound
    max_lexer_states: int = 250_000

    def __post_init__(self) -> None:
        if self.max_source_bytes < 1 or self.compile_timeout_s <= 0 or self.cache_size < 1:
            raise ValueError("GrammarConfig: max_source_bytes, compile_timeout_s and cache_size must be > 0")


@dataclass(frozen=True)
class CompiledGrammar:
    kind: str
    key: str
    grammar: str  # llguidance's grammar (JSON text), ready for LLMatcher


def canonical(spec: StructuredOutput) -> str:
    """Cache key text: JSON schemas re-serialised with sorted keys, others verbatim."""
    if spec.json_schema is not None:
        try:
            return json.dumps(json.loads(spec.json_schema), sort_keys=True, separators=(",", ":"))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    return spec.source


class GrammarCompiler:
    """Thread-safe compile cache over one tokenizer."""

    def __init__(self, ll_tokenizer: Any, config: GrammarConfig | None = None) -> None:
        import llguidance

        self._ll = llguidance
        self.tokenizer = ll_tokenizer
        self.config = config or GrammarConfig()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        self.hits = 0
        self.misses = 0

    def limits(self):  # -> llguidance.LLParserLimits
        c = self.config
        return self._ll.LLParserLimits(
            max_grammar_size=c.max_grammar_size,
            step_lexer_fuel=c.step_lexer_fuel,
            max_lexer_states=c.max_lexer_states,
        )

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        if len(spec.source.encode("utf-8")) > self.config.max_source_bytes:
            raise GrammarError(
                f"{spec.kind} is {len(spec.source.encode())} bytes; the limit is {self.config.max_source_bytes}"
            )
        key = (spec.kind, canonical(spec))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        fut = self._pool.submit(self._compile_uncached, spec, key[1])
        try:
            compiled = fut.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            raise GrammarError(
                f"{spec.kind} took longer than {self.config.compile_timeout_s}s to compile; simplify it"
            ) from None
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, spec: StructuredOutput, canon: str) -> CompiledGrammar:
        m = self._ll.LLMatcher
        if spec.json_schema is not None:
            _check_json_schema(canon)
            try:
                grammar = m.grammar_from_json_schema(canon, defaults={"whitespace_flexible": False})
            except ValueError as exc:
                raise GrammarError(f"json_schema rejected: {exc}") from None
        elif spec.regex is not None:
            grammar = m.grammar_from_regex(spec.regex)
        else:
            grammar = m.grammar_from_lark(spec.source)
        err = m.validate_grammar(grammar, self.tokenizer, limits=self.limits())
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"{spec.kind} rejected: {_short(err)}")
        # llguidance builds lexer states lazily: a first mask under the limits surfaces
        # grammars whose automaton explodes before the request is admitted.
        probe = m(self.tokenizer, grammar, log_level=0, limits=self.limits())
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"{spec.kind} rejected: {_short(probe.get_error())}")
        return CompiledGrammar(spec.kind, canon, grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_json_schema(canon: str) -> None:
    import jsonschema

    schema = json.loads(canon)
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"json_schema must be a JSON object or boolean, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise GrammarError(f"json_schema is invalid at {path}: {exc.message}") from None
    except RecursionError:
        raise GrammarError("json_schema nests too deeply") from None


def _short(msg: str, limit: int = 300) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[:limit] + "..."
