"""CPU that a disaggregated stack costs to start and then burns while idle, per process, on a
loopback Ray cluster.

Usage: .venv/bin/python scripts/idle_stack_cpu.py [--seconds S]

Brings up two prefill and two decode instances of EP 2 (eight engine actors, tiny random
checkpoint, CPU), a 12-node KV store with its Redis directory, and the API with the router in
this process. It reports the start-up
time and the CPU each engine actor spent until the stack was up (importing torch is most of
it), serves one chat, waits 3 s, then reads every process's CPU time from ``/proc`` before
and after ``S`` idle seconds.
An idle stack should cost next to nothing: engines that push unchanged state, or EP groups
that agree at full rate, show up here (docs/disaggregation.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """pid -> (user + system CPU seconds, command line) for every process readable."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(d.name)] = ((int(fields[11]) + int(fields[12])) / tick, cmd[:80] or d.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="idle time measured")
    args = parser.parse_args()

    import openai

    from engine.checkpoint.generate import generate_checkpoint
    from kvstore.cluster import LocalClusterConfig
    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.server import ServerThread
    from services.eplb.controller import EplbConfig
    from services.local.store import LocalStore
    from services.ray.local_cluster import init_local_ray
    from services.ray.serving import PoolConfig, RayServingClient

    model = Path(tempfile.mkdtemp(prefix="sluice-idle-"))
    generate_checkpoint("tiny", model, seed=0)
    init_local_ray(num_cpus=2, resources={"prefill": 4, "decode": 4})
    with LocalStore(LocalClusterConfig(nodes=12)) as store:
        engine = {"num_blocks": 32, "max_num_batched_tokens": 256, "kv_store": str(store.spec_path)}

        def pool(role: str) -> PoolConfig:
            eplb = EplbConfig(role, num_redundant_per_rank=1, window_steps=8, period_steps=16)
            return PoolConfig(
                2, engine, resources={role: 1}, expert_parallel=2, eplb=dataclasses.asdict(eplb)
            )

        client = RayServingClient(model, pool("prefill"), pool("decode"))
        app = create_app(ApiConfig(), client)
        t0 = time.monotonic()
        with ServerThread(app, app.state.sluice.config) as srv:
            print(f"stack up in {time.monotonic() - t0:.1f} s", flush=True)
            actors = sorted(s for s, cmd in cpu_seconds().values() if "EngineActor" in cmd)
            if actors:
                print(
                    f"CPU each of the {len(actors)} engine actors used to start: "
                    f"{actors[0]:.2f}-{actors[-1]:.2f} s (median {actors[len(actors) // 2]:.2f})",
                    flush=True,
                )
            oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=120, max_retries=0)
            chat = [{"role": "user", "content": "Write a haiku about rivers."}]
            t0 = time.monotonic()
            oai.chat.completions.create(model="deepseek-chat", messages=chat, max_tokens=16, temperature=0.0)
            print(f"a 16-token chat: {time.monotonic() - t0:.2f} s", flush=True)
            time.sleep(3.0)
            before, t0 = cpu_seconds(), time.monotonic()
            time.sleep(args.seconds)
            after, wall = cpu_seconds(), time.monotonic() - t0
    me = os.getpid()
    used = sorted(
        (
            (after[p][0] - before[p][0], "API + router (this process)" if p == me else after[p][1])
            for p in after
            if p in before
        ),
        reverse=True,
    )
    print(f"\nCPU seconds over {wall:.0f} idle seconds, by process:")
    for secs, cmd in used[:14]:
        print(f"{secs:7.2f}  {cmd}")
    total = sum(s for s, _ in used)
    print(f"{total:7.2f}  all processes ({total / wall:.2f} cores)")


if __name__ == "__main__":
    main()
