"""The stack across two hosts: two network namespaces on this machine (``netns.TwoSites``),
each a Ray node, joined by one link shaped to ``RATE_MBIT``.

* **Two datacentres** (``mode: two-datacenters``): prefill in site a, decode in site b, the
  KV store in a. Greedy answers equal one engine's; every handoff crosses the link over
  gRPC (the bytes show on the link's counter) and takes at least its bytes over the link's
  rate.
* **An EP instance across hosts** (``mode: ray-cluster``): the decode instance's two ranks
  run one per host and meet over the link (gloo on the interface of the Ray node IP).

Each namespace is a host: its own loopback, one interface, nothing reachable outside the
pair. Ray runs with token authentication; the store's Redis has a password (it listens on
the link's address, not on loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.ray.conftest import completion_text, served
from tests.integration.sites import netns

pytestmark = pytest.mark.integration  # ~55 s on 2 cores: two Ray nodes, a store, two deployments

RATE_MBIT = 20.0  # the link: slow enough that a handoff's transfer time is measurable
RAY_PORT = 6380
HEAD = f"{netns.ADDRESSES['a']}:{RAY_PORT}"
PROMPTS = ("two sites: ", "a request whose prefill and decode run in two places " * 8, "def f(x):\n")
N_TOKENS = 12

# Run in site a: a greedy completion per prompt through the `openai` SDK, then the
# handoff counters from /metrics, as one JSON line.
CLIENT = r"""
import json, sys, time, httpx, openai
prompts, n = json.loads(sys.argv[1]), int(sys.argv[2])
base = "http://127.0.0.1:8000"
deadline = time.monotonic() + 120
while True:
    try:
        if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the API never became ready")
    time.sleep(0.5)
oai = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
texts = [oai.completions.create(model="deepseek-chat", prompt=p, max_tokens=n, temperature=0.0,
                                extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
metrics = {}
for line in httpx.get(f"{base}/metrics").text.splitlines():
    if line.startswith(("sluice_pool_handoff_bytes_total", "sluice_pool_handoffs_total",
                        "sluice_handoff_seconds_sum")):
        name, value = line.rsplit(" ", 1)
        metrics[name] = float(value)
admin = httpx.get(f"{base}/admin/engines", headers={"Authorization": "Bearer site-admin"}).json()
print(json.dumps({"texts": texts, "metrics": metrics, "engines": admin["engines"]}))
"""


@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def sites(model) -> Iterator[tuple[netns.TwoSites, Path, dict[str, str]]]:
    why = netns.available()
    if why is not None:
        pytest.skip(f"two emulated hosts need network namespaces: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="slms"))  # short: Ray's socket paths must stay < 108 bytes
    token = tmp / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0",
        "SLUICE_ADMIN_KEYS": "site-admin", "PYTHONPATH": os.pathsep.join(sys.path),
    }  # fmt: skip
    ray_bin = str(Path(sys.executable).parent / "ray")
    with netns.TwoSites(RATE_MBIT) as s:
        s.run("a", [sys.executable, "-m", "services.cli", "store", "cluster", "--host", netns.ADDRESSES["a"],
                    "--nodes", "12", "--redis", "--spec-out", str(tmp / "store.json")], tmp / "store.log", env)  # fmt: skip
        common = ["--block", "--num-cpus", "2", "--disable-usage-stats", "--temp-dir", str(tmp / "ray")]
        _start_ray_node(s, "a", [ray_bin, "start", "--head", "--port", str(RAY_PORT), "--node-ip-address",
                                 netns.ADDRESSES["a"], "--include-dashboard", "false", "--resources",
                                 json.dumps({"prefill": 1, "decode": 1, "dc:a": 1}), *common],
                        tmp / "ray-a.log", env, nodes=1)  # fmt: skip
        _wait_for(lambda: (tmp / "store.json").exists(), 60, "the store spec", tmp / "store.log")
        _start_ray_node(s, "b", [ray_bin, "start", "--address", HEAD, "--node-ip-address", netns.ADDRESSES["b"],
                                 "--resources", json.dumps({"decode": 1, "dc:b": 1}), *common],
                        tmp / "ray-b.log", env, nodes=2)  # fmt: skip
        yield s, tmp, env


def _start_ray_node(
    s: netns.TwoSites, site: str, argv: list[str], log: Path, env: dict[str, str], nodes: int
) -> None:
    """``ray start --block`` in ``site`` until the cluster has ``nodes`` alive nodes, within 180 s.
    A start that exits is made again (three tries): Ray gives a new raylet a fixed 30 s to
    register with the GCS, which a loaded 2-core machine has missed ("The current node timed
    out during startup"); what that try started is killed first."""
    deadline, starts = time.monotonic() + 180, 0
    while starts < 3 and time.monotonic() < deadline:
        proc, starts = s.run(site, argv, log, env), starts + 1
        while proc.poll() is None and time.monotonic() < deadline:
            if _nodes(s, env) >= nodes:
                return
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise AssertionError(f"Ray node {nodes} (site {site}) not up within 180 s ({starts} starts):\n{tail}")


def _nodes(s: netns.TwoSites, env: dict[str, str]) -> int:
    """Alive Ray nodes, as a driver at site a sees them; 0 while it cannot tell. The probe exits
    as soon as it has printed: on a loaded 2-core machine a driver's orderly exit outlasted the
    probe's bound after the count was out (import and connect alone took 12 s there)."""
    code = (
        f"import os, ray; ray.init(address={HEAD!r}, log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()), flush=True); os._exit(0)"
    )
    try:
        return int(s.call("a", [sys.executable, "-c", code], 60, env).strip().splitlines()[-1])
    except (RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def _wait_for(ok, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"{what} not up within {timeout_s} s:\n{tail}")
        time.sleep(0.5)


def _serve(s: netns.TwoSites, tmp: Path, env: dict[str, str], name: str, spec: str) -> dict:
    """Serve ``spec`` from site a, run the client there, stop the server; the client's JSON."""
    store = json.loads((tmp / "store.json").read_text())
    path = tmp / f"{name}.yaml"
    path.write_text(spec.replace("{redis}", store["directory"]))
    server = s.run("a", [sys.executable, "-m", "services.cli", "serve", "--config", str(path),
                         "--store", str(tmp / "store.json"), "--ray-address", HEAD], tmp / f"{name}.log", env)  # fmt: skip
    try:
        out = s.call("a", [sys.executable, "-c", CLIENT, json.dumps(PROMPTS), str(N_TOKENS)], 300, env)
    except RuntimeError as exc:
        raise AssertionError(
            f"{exc}\nserver log:\n{(tmp / f'{name}.log').read_text(errors='replace')[-4000:]}"
        ) from None
    finally:
        os.killpg(server.pid, 15)  # SIGTERM: the server drains, stops its actors and ends
        server.wait(120)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def want(model) -> list[str]:
    from services.api.inprocess import InProcessEngineClient

    with served(InProcessEngineClient(model)) as url:
        return [completion_text(url, p, N_TOKENS) for p in PROMPTS]


TWO_DC = """mode: two-datacenters
model: {model}
redis_url: {{redis}}
api: {{host: 127.0.0.1, port: 8000}}
prefill: {{replicas: 1, datacenter: a}}
decode: {{replicas: 1, datacenter: b}}
handoff: {{bind_host: 0.0.0.0}}
interconnect_gbps: {{a-b: {gbps}}}
"""


def test_prefill_in_one_datacentre_decode_in_the_other(sites, model, want):
    s, tmp, env = sites
    sent_before = s.sent_bytes("a")
    got = _serve(s, tmp, env, "two-dc", TWO_DC.format(model=model, gbps=RATE_MBIT / 1000))
    assert got["texts"] == want
    hosts = {e["pool"]: e["host"] for e in got["engines"]}
    assert hosts == {"prefill": netns.ADDRESSES["a"], "decode": netns.ADDRESSES["b"]}
    m = got["metrics"]
    handoffs = m['sluice_pool_handoffs_total{engine="decode-0",pool="decode"}']
    moved = m['sluice_pool_handoff_bytes_total{engine="decode-0",pool="decode"}']
    assert handoffs == len(PROMPTS) and moved > 10_000
    # the payloads went a -> b over the link: its counter saw them, and no faster than its rate
    assert s.sent_bytes("a") - sent_before >= moved
    assert m['sluice_handoff_seconds_sum{engine="decode-0"}'] >= moved * 8 / (RATE_MBIT * 1e6)


EP_ACROSS = """mode: ray-cluster
model: {model}
redis_url: {{redis}}
api: {{host: 127.0.0.1, port: 8000}}
prefill: {{replicas: 1}}
decode: {{replicas: 1, expert_parallel: 2}}
"""


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_an_ep_instance_across_two_hosts(sites, model, want):
    s, tmp, env = sites
    got = _serve(s, tmp, env, "ep-across", EP_ACROSS.format(model=model))
    assert got["texts"] == want
    ranks = {e["name"]: e["host"] for e in got["engines"] if e["pool"] == "decode"}
    assert sorted(ranks.values()) == [netns.ADDRESSES["a"], netns.ADDRESSES["b"]], ranks
