"""Step-time cost models for prefill chunks and decode steps (pure numpy).

Prefill, the vLLM ``ProfilingChunkScheduler`` form (DeepSeek's published chunking design) plus
one term::

    step_time(C, H) = a * C * (C + H) + b * (C + H) + d * C + c        [seconds]

* ``C`` is the number of new tokens computed in the step (the chunk).
* ``H`` is the number of tokens already in the sequence's KV cache: the cached prefix
  plus earlier chunks.
* ``a`` is the attention term: each new token attends to ``C + H`` keys.
* ``b`` is the per-context-token term: KV reads, compressor and indexer work.
* ``d`` is the per-new-token term: projections and MoE, independent of context.
* ``c`` is the fixed launch cost.

With ``d = 0`` this is exactly the vLLM form. Without ``d``, the dense per-token work
would have to sit in ``b``. A step of a few new tokens after a long cached prefix would
then cost as much as computing the prefix: a 94 % prefix hit would save only ~28 % of the
prefill time.

Decode is one continuous-batching step over ``B`` running sequences holding ``K`` KV
tokens in total::

    step_time(B, K) = d0 + d1 * B + d2 * K                       [seconds]

Default coefficients are for an H200-class GPU serving DeepSeek-V4.1-Flash, from DeepInfer's
published figures.

* **Prefill.** DeepInfer reports ~60,000 prefill tok/s/GPU at 4,096 tokens per rank, so
  one 4,096-token chunk with no prefix takes 4096 / 60000 = 68.3 ms. We split it as:
  * c = 2 ms of launch;
  * an attention share of 10 % at that size, a = 6.83 ms / 4096^2;
  * a KV-read term b = 0.2 us per context token (0.8 ms at 4K);
  * the rest per new token, d = 14.3 us.

  The split is an assumption until Engine II's fit from measurements replaces it
  (``CostModel.fit`` / ``from_json``).
* **Decode.** ~100 tok/s per user at 256 requests per rank means a ~10 ms step at
  B = 256. We take d0 = 5 ms, d1 = 10 us per sequence and d2 = 1.5 ns per KV token
  (256 sequences of 8K context add ~3 ms), which gives 10.6 ms at (256, 2M).

The API is deliberately small: ``predict``, ``prefill_time``, ``fit``, ``to_json`` and
``from_json``. Engine II imports it to save fitted coefficients. This is a leaf package:
it imports numpy and nothing from engine, router, services or kvstore, so both the engine
(chunk sizing) and the router (policies, simulator) can depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_CHUNK_BUDGET = 32_768  # tokens per prefill step (DeepSeek's published chunk budget)

_PREFILL_4K_S = 4096 / 60_000.0
_C_DEFAULT = 0.002
_A_DEFAULT = 0.10 * _PREFILL_4K_S / 4096**2
_B_DEFAULT = 0.2e-6
_D_DEFAULT = (_PREFILL_4K_S - _C_DEFAULT - 0.10 * _PREFILL_4K_S - _B_DEFAULT * 4096) / 4096


@dataclass(frozen=True)
class CostModel:
    """Prefill step time ``a*C*(C+H) + b*(C+H) + d*C + c`` in seconds (module docstring)."""

    a: float = _A_DEFAULT
    b: float = _B_DEFAULT
    c: float = _C_DEFAULT
    d: float = _D_DEFAULT
    chunk_budget: int = DEFAULT_CHUNK_BUDGET

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if self.a == 0 and self.b == 0 and self.d == 0:
            raise ValueError("CostModel needs a, b or d > 0: with all three 0 prefill would be free")
        if self.chunk_budget < 1:
            raise ValueError(f"CostModel.chunk_budget must be >= 1 token, got {self.chunk_budget}")

    def predict(self, chunk: float, prefix: float) -> float:
        """Seconds for one step computing ``chunk`` new tokens after ``prefix`` cached ones."""
        total = chunk + prefix
        return self.a * chunk * total + self.b * total + self.d * chunk + self.c

    def prefill_time(self, input_len: int, cached: int = 0) -> float:
        """Seconds to prefill ``input_len`` tokens of which the first ``cached`` are cached.

        The uncached tail is computed in chunks of ``chunk_budget`` tokens, one step each.
        At least one token is always computed (the last token's logits are needed).
        """
        if input_len <= 0:
            return 0.0
        done = min(max(cached, 0), input_len - 1)
        if input_len - done <= self.chunk_budget:  # one step (most requests): no loop
            return self.predict(input_len - done, done)
        t = 0.0
        while done < input_len:
            step = min(self.chunk_budget, input_len - done)
            t += self.predict(step, done)
            done += step
        return t

    @classmethod
    def fit(
        cls,
        samples: Iterable[tuple[float, float, float]],
        chunk_budget: int = DEFAULT_CHUNK_BUDGET,
        with_d: bool = True,
    ) -> CostModel:
        """Least-squares fit from ``(chunk, prefix, seconds)`` samples; coefficients clipped at 0.

        ``with_d=False`` fits the plain vLLM form (d = 0). Raises ValueError with too few
        samples or when the samples do not vary enough (e.g. every prefix is 0, which
        cannot separate ``b`` from ``d``: pass ``with_d=False`` or add prefixed samples).
        """
        arr = np.asarray(list(samples), dtype=np.float64)
        cols = 4 if with_d else 3
        if arr.ndim != 2 or arr.shape[0] < cols or arr.shape[1] != 3:
            raise ValueError(f"CostModel.fit needs >= {cols} samples of (chunk, prefix, seconds)")
        chunk, prefix, y = arr[:, 0], arr[:, 1], arr[:, 2]
        feats = [chunk * (chunk + prefix), chunk + prefix, np.ones_like(chunk)] + ([chunk] if with_d else [])
        x = np.stack(feats, axis=1)  # [S, cols]
        if np.linalg.matrix_rank(x) < cols:
            raise ValueError("CostModel.fit: samples do not vary enough in chunk and prefix to fit the terms")
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        v = [max(float(k), 0.0) for k in coef] + ([] if with_d else [0.0])
        return cls(a=v[0], b=v[1], c=v[2], d=v[3], chunk_budget=chunk_budget)

    def to_json(self) -> str:
        return json.dumps({"kind": "prefill_quadratic", **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        raw = json.loads(text)
        if raw.pop("kind", "prefill_quadratic") != "prefill_quadratic":
            raise ValueError("not a prefill cost model JSON (kind != 'prefill_quadratic')")
        unknown = set(raw) - {"a", "b", "c", "d", "chunk_budget"}
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; expected a, b, c, d, chunk_budget")
        raw.setdefault("d", 0.0)  # a plain vLLM-form fit
        return cls(**raw)


@dataclass(frozen=True)
class DecodeCostModel:
    """Decode step time ``d0 + d1*B + d2*K`` in seconds for B sequences holding K KV tokens."""

    d0: float = 0.005
    d1: float = 10e-6
    d2: float = 1.5e-9

    def __post_init__(self) -> None:
        for name in ("d0", "d1", "d2"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"DecodeCostModel.{name} must be a finite number >= 0, got {v!r}")
        if self.d0 == 0 and self.d1 == 0 and self.d2 == 0:
            raise ValueError("DecodeCostModel needs at least one positive coefficient")

    def step_time(self, batch: int, kv_tokens: float) -> float:
        return self.d0 + self.d1 * batch + self.d2 * kv_tokens

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float, float]]) -> DecodeCostModel:
        """Least squares on *relative* error from ``(batch, kv_tokens, seconds)`` samples;
        coefficients clipped at 0.

        Relative, because a step grows more slowly than linearly in the batch (a batch's
        routed experts overlap more as it grows): an absolute fit is ruled by the largest
        steps and misses the small ones by 55-180 % (the H200 and CPU tables), while the
        router compares engines by their relative cost and the fit is graded by its relative
        error. Exact on samples of a linear model either way."""
        arr = np.asarray(list(samples), dtype=np.float64)
        if arr.ndim != 2 or arr.shape[0] < 3 or arr.shape[1] != 3:
            raise ValueError("DecodeCostModel.fit needs >= 3 samples of (batch, kv_tokens, seconds)")
        if not np.all(np.isfinite(arr)) or np.any(arr[:, 2] <= 0):
            raise ValueError("DecodeCostModel.fit: step times must be finite and > 0")
        x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)  # [S, 3]
        if np.linalg.matrix_rank(x) < 3:
            raise ValueError("DecodeCostModel.fit: samples must vary in both batch and kv_tokens")
        coef, *_ = np.linalg.lstsq(x / arr[:, 2:3], np.ones(len(arr)), rcond=None)
        d0, d1, d2 = (max(float(v), 0.0) for v in coef)
        return cls(d0=d0, d1=d1, d2=d2)

    def to_json(self) -> str:
        return json.dumps({"kind": "decode_linear", **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> DecodeCostModel:
        raw = json.loads(text)
        if raw.pop("kind", "decode_linear") != "decode_linear":
            raise ValueError("not a decode cost model JSON (kind != 'decode_linear')")
        return cls(**raw)
