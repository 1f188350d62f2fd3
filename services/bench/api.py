"""``sluice bench api``: what the HTTP layer costs and how fast it refuses.

Three measurements in one run, on the same checkpoint (tiny by default, where the model
step is cheapest, so the API's share of the time is largest):

1. throughput: ``streams`` concurrent chat requests of ``max_tokens`` each, first straight
   through ``InProcessEngineClient.generate`` (no HTTP, no recipe), then through the HTTP
   server with the official ``openai`` SDK streaming; ratio api / engine;
2. refusal latency: bad requests (limits, malformed JSON, auth) sent one by one while the
   server is idle, p50 / p99;
3. overload: ``4 x streams`` simultaneous requests against ``streams`` slots and
   ``streams`` queue places: how many are refused, and how fast.

With ``--replicas N`` (N > 1) the run compares routing policies over N in-process replicas
on a shared-prefix workload instead (``services/bench/_api_routing.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.bench import Report, progress
from services.bench._api_routing import add_routing_arguments, run_routing

KEY = "sk-bench"
PROMPT = [{"role": "user", "content": "Write a short poem about rivers and sluices."}]
BAD_BODIES: list[tuple[str, bytes]] = [
    ("malformed", b'{"model": "deepseek-chat", "messages": [}'),
    ("n", json.dumps({"model": "deepseek-chat", "messages": PROMPT, "n": 1000}).encode()),
    ("max_tokens", json.dumps({"model": "deepseek-chat", "messages": PROMPT, "max_tokens": 10**9}).encode()),
    ("top_logprobs", json.dumps({"model": "deepseek-chat", "messages": PROMPT, "top_logprobs": 300}).encode()),
    ("model", json.dumps({"model": "gpt-4o", "messages": PROMPT}).encode()),
    ("schema", json.dumps({"model": "deepseek-chat", "messages": PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}}).encode()),
]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: generate tiny in a temp dir)"
    )
    p.add_argument("--streams", type=int, default=4, help="concurrent requests in the throughput phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rejects", type=int, default=300, help="bad requests in the refusal phase")
    add_routing_arguments(p)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _engine_throughput(model: Path, streams: int, max_tokens: int) -> dict[str, float]:
    from services.api.config import ApiConfig
    from services.api.convert import Converter
    from services.api.inprocess import InProcessEngineClient

    async def run() -> dict[str, float]:
        client = InProcessEngineClient(model)
        conv = Converter(ApiConfig().resolve(client.model_info().model_id, 8192), client.model_info())
        await client.start()
        try:
            body = json.dumps(
                {"model": "deepseek-chat", "messages": PROMPT, "max_tokens": max_tokens}
            ).encode()

            async def one(i: int) -> int:
                prep = conv.prepare("chat", body, json.loads(body))
                outs = [o async for o in client.generate(prep.engine_request)]
                return outs[-1].completion_tokens

            await one(-1)  # warm-up
            t0 = time.monotonic()
            tokens = await asyncio.gather(*(one(i) for i in range(streams)))
            wall = time.monotonic() - t0
        finally:
            await client.close()
        return {"tokens": float(sum(tokens)), "wall_s": wall, "tokens_per_s": sum(tokens) / wall}

    return asyncio.run(run())


def _api_throughput(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    import openai

    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)

    def one(_: int) -> int:
        chunks = list(oai.chat.completions.create(  # type: ignore[call-overload]
            model="deepseek-chat", messages=PROMPT, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        usage = [c.usage for c in chunks if c.usage is not None]
        return usage[-1].completion_tokens if usage else 0

    one(-1)  # warm-up
    t0 = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        tokens = list(pool.map(one, range(streams)))
    wall = time.monotonic() - t0
    return {"tokens": float(sum(tokens)), "wall_s": wall, "tokens_per_s": sum(tokens) / wall}


def _refusals(url: str, n: int) -> dict[str, float]:
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=10, headers={"authorization": f"Bearer {KEY}"}) as c:
        for i in range(n):
            _, body = BAD_BODIES[i % len(BAD_BODIES)]
            t0 = time.monotonic()
            status = c.post("/v1/chat/completions", content=body).status_code
            times.append(time.monotonic() - t0)
            if status != 400:
                raise RuntimeError(f"bad request {i} got {status}")
        t0 = time.monotonic()
        if httpx.post(f"{url}/v1/models", timeout=10).status_code != 401:
            raise RuntimeError("missing key was not refused")
        times.append(time.monotonic() - t0)
    return {
        "count": float(len(times)),
        "p50_s": _pct(times, 0.5),
        "p99_s": _pct(times, 0.99),
        "max_s": max(times),
    }


def _overload(url: str, total: int, max_tokens: int) -> dict[str, float]:
    import httpx

    body = {"model": "deepseek-chat", "messages": PROMPT, "max_tokens": max_tokens}
    barrier = threading.Barrier(total)

    def one(_: int) -> tuple[int, float]:
        with httpx.Client(base_url=url, timeout=600, headers={"authorization": f"Bearer {KEY}"}) as c:
            barrier.wait(60)
            t0 = time.monotonic()
            status = c.post("/v1/chat/completions", json=body).status_code
            return status, time.monotonic() - t0

    with ThreadPoolExecutor(total) as pool:
        results = list(pool.map(one, range(total)))
    refused = [t for s, t in results if s in (429, 503)]
    served = [t for s, t in results if s == 200]
    return {
        "sent": float(total), "served": float(len(served)), "refused": float(len(refused)),
        "refused_p99_s": _pct(refused, 0.99), "served_median_s": statistics.median(served) if served else float("nan"),
    }  # fmt: skip


def run(args: argparse.Namespace) -> Report:
    import logging

    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.inprocess import InProcessEngineClient
    from services.api.server import ServerThread

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    tmp = None
    model = args.model
    if model is None:
        from engine.checkpoint.generate import generate_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="sluice-bench-api-")
        model = Path(tmp.name) / "tiny"
        progress("generating the tiny checkpoint")
        generate_checkpoint("tiny", model, seed=0)
    if args.replicas > 1:
        try:
            return run_routing(args, model)
        finally:
            if tmp is not None:
                tmp.cleanup()
    config: dict[str, Any] = {"model": str(model), "streams": args.streams, "max_tokens": args.max_tokens,
                              "rejects": args.rejects}  # fmt: skip
    report = Report("api", config)
    progress("engine alone")
    direct = _engine_throughput(model, args.streams, args.max_tokens)
    cfg = ApiConfig(
        api_keys=(KEY,), max_concurrency=args.streams, max_queue=args.streams, queue_timeout_s=300
    )
    app = create_app(cfg, InProcessEngineClient(model))
    with ServerThread(app, app.state.sluice.config) as srv:
        progress("through the API")
        api = _api_throughput(srv.url, args.streams, args.max_tokens)
        progress("refusals")
        refusals = _refusals(srv.url, args.rejects)
        progress("overload")
        overload = _overload(srv.url, 4 * args.streams, args.max_tokens)
    if tmp is not None:
        tmp.cleanup()
    report.results = {"engine": direct, "api": api, "refusals": refusals, "overload": overload}
    ratio = api["tokens_per_s"] / direct["tokens_per_s"]
    report.rows = [
        {"phase": "engine alone", "tokens_per_s": direct["tokens_per_s"], "wall_s": direct["wall_s"]},
        {"phase": "api (openai SDK, SSE)", "tokens_per_s": api["tokens_per_s"], "wall_s": api["wall_s"]},
        {"phase": "refusals", "p50_s": refusals["p50_s"], "p99_s": refusals["p99_s"]},
        {
            "phase": "overload",
            "served": overload["served"],
            "refused": overload["refused"],
            "p99_s": overload["refused_p99_s"],
        },  # fmt: skip
    ]
    report.target("api_tokens_per_s / engine_tokens_per_s", ratio, ">=", 0.8)
    report.target("refusal_p99_s", refusals["p99_s"], "<=", 1.0)
    report.target("overload_refusal_p99_s", overload["refused_p99_s"], "<=", 1.0)
    report.target(
        "overload_served / (max_concurrency + max_queue)", overload["served"] / (2 * args.streams), "==", 1.0
    )
    return report
