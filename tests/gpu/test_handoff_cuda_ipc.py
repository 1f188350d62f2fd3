"""Sequence handoff between two processes through CUDA IPC (``CudaIpcTransport``), no Ray.

Process A runs an ``EngineCore`` on CUDA (tiny, fp32), prefills, exports and offers the
payload through a CUDA IPC buffer; process B, with its own engine, claims it, imports it and
continues. Greedy and seeded tokens equal a single-process run on the same GPU. Both
processes use one GPU (NCCL refuses two ranks on one GPU; CUDA IPC does not care); with two
GPUs, B also runs on the other one. The processes meet through a FileStore (nothing listens).
Printed: payload bytes and transfer ms, and the bandwidth of a 1 GiB device-to-device
transfer. Also checked: the sender's buffer is freed after the ack, and after a timeout with
no receiver (not left in torch's IPC limbo).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

from engine.checkpoint.generate import generate_checkpoint
from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.distributed.rendezvous import rendezvous_file
from engine.kvconnector.device_transport import (
    CudaIpcTransport,
    TransportKind,
    TransportTimeout,
    pick_transport,
)
from tests.engine_steps import GREEDY, SEEDED, prompt, step_until

pytestmark = pytest.mark.gpu

# (request id, prompt length, outputs stepped for before the export, params)
CASES = [
    ("ipc-greedy", 300, 1, GREEDY),
    ("ipc-seeded", 2 * 256 - 3, 6, SEEDED),
    ("ipc-long", 3000, 1, GREEDY),
]
BULK = 1 << 30


def reference(model: str, device: str) -> dict[str, tuple[list[int], str | None]]:
    ref = EngineCore(EngineConfig(model=model, device=device, enable_prefix_caching=False))
    try:
        out = {}
        for i, (rid, plen, _, params) in enumerate(CASES):
            ref.add(CoreRequest(rid, tuple(prompt(plen, i)), params))
            out[rid] = step_until(ref, rid)
        return out
    finally:
        ref.close()


def meet(store: dist.Store, tag: str, rank: int) -> None:
    """Both processes at this point, so the next transfer's time is the transfer's alone."""
    store.set(f"meet/{tag}/{rank}", "1")
    store.wait([f"meet/{tag}/{1 - rank}"], datetime.timedelta(seconds=120))


def _worker(rank: int, store_path: str, model: str, out_dir: str, devices: list[str]) -> None:
    device = devices[rank]
    torch.cuda.set_device(torch.device(device))
    store = dist.FileStore(store_path, 2)
    xport = CudaIpcTransport(store, device, timeout_s=60)
    core = EngineCore(EngineConfig(model=model, device=device))
    result: dict[str, object] = {}
    try:
        for i, (rid, plen, after, params) in enumerate(CASES):
            if rank == 0:
                core.add(CoreRequest(rid, tuple(prompt(plen, i)), params))
                tokens, finish = step_until(core, rid, n=after)
                assert finish is None
                payload = core.export_sequence(rid)
                tokens += [t for o in core.take_outputs() for t in o.new_token_ids]
                meet(store, rid, rank)
                stats = xport.send(rid, payload)
                result[rid] = {"tokens": tokens, "bytes": stats.nbytes, "ms": stats.ms}
            else:
                meet(store, rid, rank)
                t0 = time.perf_counter()
                payload = xport.recv(rid)
                ms = (time.perf_counter() - t0) * 1e3
                assert core.import_sequence(payload) == rid
                tokens, finish = step_until(core, rid)
                result[rid] = {"tokens": tokens, "finish": finish, "bytes": len(payload), "recv_ms": ms}
        # Bulk: 1 MiB to warm up, then 1 GiB, device to device (recv_tensor: no host copy).
        for key, n in (("warm", 1 << 20), ("bulk", BULK)):
            if rank == 0:
                data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
                digest = xxhash.xxh3_64_intdigest(data.cpu().numpy().tobytes())
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(device)
                meet(store, key, rank)
                stats = xport.send(key, data)
                after = torch.cuda.memory_allocated(device)
                result[key] = {
                    "digest": digest,
                    "ms": stats.ms,
                    "gbps": stats.gb_per_s,
                    "leak": after - before,
                }
            else:
                meet(store, key, rank)
                got = xport.recv_tensor(key)
                assert got.device == torch.device(device) and got.numel() == n
                result[key] = {"digest": xxhash.xxh3_64_intdigest(got.cpu().numpy().tobytes())}
                del got
        # Nobody claims: the sender gives up and its buffer is freed (the IPC reference given back).
        if rank == 0:
            lonely = CudaIpcTransport(store, device, timeout_s=1.0)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            try:
                lonely.send("nobody", torch.ones(64 << 20, dtype=torch.uint8, device=device))
            except TransportTimeout as exc:
                result["timeout"] = str(exc)
            result["timeout_leak"] = torch.cuda.memory_allocated(device) - before
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        core.close()


def _receivers() -> list[str]:
    return ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0"]


@pytest.mark.parametrize("receiver", _receivers())
def test_handoff_through_cuda_ipc_equals_one_process(tmp_path, receiver) -> None:
    assert pick_transport("cuda:0", receiver, same_host=True) is TransportKind.CUDA_IPC
    model = str(generate_checkpoint("tiny", tmp_path / "tiny").path)
    want = reference(model, "cuda:0")
    rendezvous = rendezvous_file()
    out = tmp_path / "out"
    out.mkdir()
    try:
        mp.spawn(_worker, args=(rendezvous.path, model, str(out), ["cuda:0", receiver]), nprocs=2, join=True)
    finally:
        rendezvous.close()
    a = json.loads((out / "0.json").read_text())
    b = json.loads((out / "1.json").read_text())
    for rid, plen, after, params in CASES:
        tokens, finish = want[rid]
        assert finish == "length" and len(tokens) == params.max_tokens
        # at least `after`: a pipelined step in flight at the export adds its token
        assert len(a[rid]["tokens"]) >= after, rid
        assert a[rid]["tokens"] + b[rid]["tokens"] == tokens, rid
        assert b[rid]["finish"] == "length" and a[rid]["bytes"] == b[rid]["bytes"]
        print(
            f"CUDA IPC cuda:0 -> {receiver}, {rid} (prompt {plen}): {a[rid]['bytes']:,} B, "
            f"send to ack {a[rid]['ms']:.2f} ms, recv {b[rid]['recv_ms']:.2f} ms"
        )
    assert a["bulk"]["digest"] == b["bulk"]["digest"] and a["warm"]["digest"] == b["warm"]["digest"]
    print(
        f"CUDA IPC cuda:0 -> {receiver}, 1 GiB device to device: {a['bulk']['ms']:.1f} ms "
        f"({a['bulk']['gbps']:.1f} GB/s, to ack)"
    )
    assert a["bulk"]["leak"] == 0 and a["warm"]["leak"] == 0, "the sender's buffer outlived the ack"
    assert "no receiver claimed" in a["timeout"]
    assert a["timeout_leak"] == 0, "an unclaimed buffer was not freed"
