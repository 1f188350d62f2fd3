"""The SGLang router (``sglang-router`` on PyPI, its Rust binary) as a peer on the same trace.

Two real router processes run with ``--policy cache_aware`` (its defaults otherwise): one
in front of the N simulated prefill engines and one in front of the M decode engines, all
served over HTTP on 127.0.0.1. The client sends each request to the prefill router, then
to the decode router, as a PD proxy would. (sglang-router 0.3.2's own
``--pd-disaggregation`` mode logs "No tree found for model 'unknown', using random worker
selection" for every request, i.e. its cache-aware prefill choice degrades to random;
two regular-mode instances give the peer its real cache-aware behaviour.)

Each fake prefill engine holds a request for the time the simulator's engine would (FIFO
queue, LRU block cache, the same cost model), time-compressed by ``speedup``, so the
router's in-flight load counters see a realistic queue; each fake decode engine holds it
for a decode time. The engines record which one the router picked for every request;
those choices are then replayed through the same simulator as every Sluice policy
(``router.evaluate.Replay``), so all metrics come from one model.

Prompts are rendered as text, one fixed-width 13-character word per 512-token block id
(scrambled hex), so SGLang's character radix tree sees exactly the block-prefix structure
of the trace (match rate by characters = match rate by blocks). ``--max-tree-size`` is
set to the engine cache capacity in those characters.

Bounded: requests = rows of the subset, wall time = budget (+ startup), loopback only.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.evaluate import POLICY_NAMES, evaluate, replay_builder, score, simulate
from router.sim import PrefillEngineState, SimConfig
from router.trace import Trace
from services.local.procs import free_port

BLOCK_CHARS = 13  # 12 hex digits and a space per block
_MIX = 0x9E3779B97F4A7C15  # odd: multiplication mod 2**48 is a bijection on block ids


class PeerUnavailable(RuntimeError):
    """The sglang-router peer could not run or did not route every request."""


def block_text(blocks: tuple[int, ...]) -> str:
    """One 12-hex-digit word per block id; distinct ids give distinct words that differ
    early (ids are scrambled), so a character prefix match is a block prefix match."""
    return "".join(f"{(b * _MIX) % (1 << 48):012x} " for b in blocks)


@dataclass
class _World:
    """The fake engines' shared state, in simulated seconds (wall * speedup)."""

    trace: Trace
    cfg: SimConfig
    speedup: float
    t0: float = 0.0
    prefill_choice: dict[int, int] = field(default_factory=dict)
    decode_choice: dict[int, int] = field(default_factory=dict)
    busy: list[float] = field(default_factory=list)
    engines: list[PrefillEngineState] = field(default_factory=list)
    decode_running: list[int] = field(default_factory=list)

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.speedup


def _reply() -> dict[str, Any]:
    return {"text": "", "meta_info": {"id": "0", "finish_reason": {"type": "length"}, "prompt_tokens": 1}}


async def _prefill_handler(world: _World, e: int, body: dict[str, Any]) -> dict[str, Any]:
    i = int(body["rid"])
    world.prefill_choice[i] = e
    eng = world.engines[e]
    blocks = world.trace.blocks[i]
    start = max(world.now(), world.busy[e])
    cached = min(eng.lookup(blocks) * world.trace.block_size, int(world.trace.input_len[i]))
    world.busy[e] = start + world.cfg.cost.prefill_time(int(world.trace.input_len[i]), cached)
    eng.insert(blocks)
    await asyncio.sleep(max(world.busy[e] - world.now(), 0.0) / world.speedup)
    return _reply()


async def _decode_handler(world: _World, d: int, body: dict[str, Any]) -> dict[str, Any]:
    i = int(body["rid"])
    world.decode_choice[i] = d
    world.decode_running[d] += 1
    try:
        step = world.cfg.decode_cost.step_time(world.decode_running[d], int(world.trace.input_len[i]))
        tokens = max(int(world.trace.output_len[i]) - 1, 0)
        await asyncio.sleep(min(tokens * step / world.speedup, 5.0))
    finally:
        world.decode_running[d] -= 1
    return _reply()


async def _serve(world: _World, stage: str, idx: int) -> tuple[Any, int]:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        if request.method == "POST" and request.path in ("/generate", "/v1/completions"):
            body = await request.json()
            fn = _prefill_handler if stage == "prefill" else _decode_handler
            return web.json_response(await fn(world, idx, body))
        return web.json_response({"status": "ok", "model_path": "sluice-sim", "is_generation": True})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def _router_cmd(worker_ports: list[int], port: int, cfg: SimConfig) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--max-tree-size", str(cfg.cache_blocks * BLOCK_CHARS),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30", "--log-level", "error",
            "--worker-urls", *(f"http://127.0.0.1:{p}" for p in worker_ports)]  # fmt: skip


async def _replay(trace: Trace, cfg: SimConfig, scale: float, budget_s: float) -> dict[str, Any]:
    from aiohttp import ClientSession, ClientTimeout

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # the router probes for HTTP/2
    arrivals = trace.arrival_s * scale
    span = float(arrivals[-1] - arrivals[0])
    speedup = max(1.0, span / budget_s)
    world = _World(trace, cfg, speedup, busy=[0.0] * cfg.num_prefill, decode_running=[0] * cfg.num_decode)
    world.engines = [PrefillEngineState(cfg.cache_blocks) for _ in range(cfg.num_prefill)]
    servers = [await _serve(world, "prefill", e) for e in range(cfg.num_prefill)]
    servers += [await _serve(world, "decode", d) for d in range(cfg.num_decode)]
    ports = [p for _, p in servers]
    router_ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(_router_cmd(group, rp, cfg), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for group, rp in (
            (ports[: cfg.num_prefill], router_ports[0]),
            (ports[cfg.num_prefill :], router_ports[1]),
        )
    ]
    errors: list[str] = []
    try:
        async with ClientSession(timeout=ClientTimeout(total=budget_s + 120)) as s:
            for rp, proc in zip(router_ports, procs):
                await _wait_healthy(s, f"http://127.0.0.1:{rp}/health", proc)
            world.t0 = time.monotonic()

            async def one(i: int) -> None:
                await asyncio.sleep(
                    max((arrivals[i] - arrivals[0]) / speedup - (time.monotonic() - world.t0), 0)
                )
                body = {"text": block_text(trace.blocks[i]), "rid": str(i),
                        "sampling_params": {"max_new_tokens": int(trace.output_len[i])}}  # fmt: skip
                try:
                    for rp in router_ports:  # prefill, then decode
                        async with s.post(f"http://127.0.0.1:{rp}/generate", json=body) as r:
                            if r.status != 200:
                                errors.append(f"{i}: HTTP {r.status} {(await r.text())[:200]}")
                                return
                except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
                    errors.append(f"{i}: {type(exc).__name__}: {exc}")

            wall0 = time.monotonic()
            await asyncio.wait_for(
                asyncio.gather(*(one(i) for i in range(len(trace)))), timeout=budget_s * 2 + 120
            )
            wall = time.monotonic() - wall0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for runner, _ in servers:
            await runner.cleanup()
    return {"prefill": world.prefill_choice, "decode": world.decode_choice, "errors": errors,
            "speedup": speedup, "wall_s": wall}  # fmt: skip


async def _wait_healthy(s: Any, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-800:] if proc.stderr else ""
            raise PeerUnavailable(f"sglang-router exited with code {proc.returncode}: {err}")
        try:
            async with s.get(url) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise PeerUnavailable("sglang-router did not report healthy within 60 s")


def compare_with_sglang(
    subset: Trace,
    cfg: SimConfig,
    load: float,
    offline_load: float,
    budget_s: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """All Sluice policies and the SGLang router on ``subset``, scored by the same simulator."""
    try:
        from sglang_router.version import __version__ as sglang_version
    except ImportError as exc:
        raise PeerUnavailable("sglang-router is not installed (pip install sglang-router==0.3.2)") from exc
    ref, results = evaluate(subset, cfg, POLICY_NAMES, load, offline_load, progress=progress)
    runs: dict[str, Any] = {}
    for mode, lf in (("online", load), ("offline", offline_load)):
        progress(f"sglang-router {sglang_version}: replaying {len(subset)} rows over HTTP ({mode})")
        rec = asyncio.run(_replay(subset, cfg, ref.time_scale(lf), budget_s))
        missing = [i for i in range(len(subset)) if i not in rec["prefill"] or i not in rec["decode"]]
        if missing or rec["errors"]:
            raise PeerUnavailable(f"{len(missing)} rows unrouted, errors: {rec['errors'][:3]}")
        pre, dec, idx = replay_builder(rec["prefill"], rec["decode"])(cfg)
        runs[mode] = simulate(subset, pre, dec, idx, cfg, ref.time_scale(lf))[0]
        runs[mode + "_http"] = {"speedup": rec["speedup"], "wall_s": rec["wall_s"], "requests": len(subset)}
    results["sglang_router"] = score(subset, ref, runs["online"], runs["offline"])
    progress(f"{subset.name} sglang_router: {results['sglang_router']}")
    return {
        "reference": ref.__dict__ | {"rows": len(subset)},
        "policies": results,
        "sglang_router": {
            "version": sglang_version,
            "mode": "two regular-mode routers (prefill pool, decode pool), --policy cache_aware",
            "http_online": runs["online_http"],
            "http_offline": runs["offline_http"],
        },  # fmt: skip
    }


__all__ = ["PeerUnavailable", "block_text", "compare_with_sglang"]
