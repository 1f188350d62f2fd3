"""``P2PTransport`` over gloo between two real processes: a sequence handoff from a real
``EngineCore`` (tiny, fp32, CPU) in one process continues in another exactly as a
single-engine run (greedy and seeded). The processes meet through a rendezvous file; gloo's
sockets stay on loopback. The CUDA paths of the same transport layer are tested in
tests/gpu/test_handoff_cuda_ipc.py and tests/gpu/test_handoff_nccl.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.kvconnector.device_transport import (
    P2P_MAGIC,
    P2PTransport,
    TransportError,
    TransportKind,
    pick_transport,
)
from tests.engine_steps import GREEDY, SEEDED, prompt, step_until

pytestmark = pytest.mark.integration

# (request id, prompt length, outputs before the export, params)
CASES = [("gloo-greedy", 300, 1, GREEDY), ("gloo-seeded", 2 * 256 - 3, 6, SEEDED)]


def _worker(rank: int, rendezvous: str, model: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's sockets on loopback
    torch.set_num_threads(1)
    join_group("gloo", rendezvous, rank, 2, timeout_s=120)
    core = EngineCore(EngineConfig(model=model))
    xport = P2PTransport(device="cpu", timeout_s=60)
    result: dict[str, object] = {}
    try:
        for i, (rid, plen, after, params) in enumerate(CASES):
            if rank == 0:
                core.add(CoreRequest(rid, tuple(prompt(plen, i)), params))
                tokens, finish = step_until(core, rid, n=after)
                assert finish is None
                payload = core.export_sequence(rid)
                tokens += [t for o in core.take_outputs() for t in o.new_token_ids]
                stats = xport.send(payload, dst=1)
                result[rid] = {"tokens": tokens, "bytes": stats.nbytes, "ms": stats.ms}
            else:
                t0 = time.perf_counter()
                payload = xport.recv(src=0)
                ms = (time.perf_counter() - t0) * 1e3
                assert core.import_sequence(payload) == rid
                tokens, finish = step_until(core, rid)
                result[rid] = {"tokens": tokens, "finish": finish, "bytes": len(payload), "recv_ms": ms}
        # A header that is not ours is refused with a clear error.
        if rank == 0:
            dist.send(torch.frombuffer(bytearray(b"NOPE" + bytes(20)), dtype=torch.uint8), dst=1)
        else:
            try:
                xport.recv(src=0)
            except TransportError as exc:
                assert "not ours" in str(exc)
                result["bad_header"] = str(exc)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        core.close()
        dist.destroy_process_group()


def test_handoff_over_gloo_equals_one_engine(checkpoint_factory, tmp_path) -> None:
    model = checkpoint_factory("tiny")
    assert pick_transport("cpu", "cpu", same_host=False, group_backend="gloo") is TransportKind.BYTES
    ref = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    want = {}
    try:
        for i, (rid, plen, _, params) in enumerate(CASES):
            ref.add(CoreRequest(rid, tuple(prompt(plen, i)), params))
            want[rid] = step_until(ref, rid)
    finally:
        ref.close()
    store = rendezvous_file()
    try:
        mp.spawn(_worker, args=(store.path, str(model), str(tmp_path)), nprocs=2, join=True)
    finally:
        store.close()
    a = json.loads((tmp_path / "0.json").read_text())
    b = json.loads((tmp_path / "1.json").read_text())
    for rid, _, after, params in CASES:
        tokens, finish = want[rid]
        assert len(tokens) == params.max_tokens and finish == "length"
        assert a[rid]["tokens"] == tokens[:after], rid
        assert a[rid]["tokens"] + b[rid]["tokens"] == tokens, rid
        assert b[rid]["finish"] == "length"
        assert a[rid]["bytes"] == b[rid]["bytes"] > 0
        print(f"{rid}: {a[rid]['bytes']:,} B over gloo, send {a[rid]['ms']:.1f} ms")
    assert P2P_MAGIC.decode() in b["bad_header"]
