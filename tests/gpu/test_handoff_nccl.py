"""Sequence handoff between two GPUs over NCCL (``P2PTransport``), no Ray (needs 2 CUDA devices).

Rank 0 runs an ``EngineCore`` on cuda:0 (tiny, fp32), prefills, exports and sends the
payload over NCCL; rank 1 imports it into its engine on cuda:1 and continues. Greedy and
seeded tokens equal a single-process run on cuda:0. Printed: payload bytes and transfer ms,
and the bandwidth of a 1 GiB device-to-device send.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

from engine.checkpoint.generate import generate_checkpoint
from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.kvconnector.device_transport import P2PTransport, TransportKind, pick_transport
from tests.engine_steps import prompt, step_until
from tests.gpu.test_handoff_cuda_ipc import BULK, CASES, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _worker(rank: int, rendezvous: str, model: str, out_dir: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)
    join_group("nccl", rendezvous, rank, 2, timeout_s=120)
    result: dict[str, object] = {}
    core = EngineCore(EngineConfig(model=model, device=device))
    try:
        dist.all_reduce(torch.zeros(1, device=device))  # p2p must not be the group's first operation
        xport = P2PTransport(device=device, timeout_s=60)
        for i, (rid, plen, after, params) in enumerate(CASES):
            if rank == 0:
                core.add(CoreRequest(rid, tuple(prompt(plen, i)), params))
                tokens, finish = step_until(core, rid, n=after)
                assert finish is None
                payload = core.export_sequence(rid)
                tokens += [t for o in core.take_outputs() for t in o.new_token_ids]
                dist.barrier(device_ids=[rank])  # both ready: the time is the transfer's alone
                stats = xport.send(payload, dst=1)
                result[rid] = {"tokens": tokens, "bytes": stats.nbytes, "ms": stats.ms}
            else:
                dist.barrier(device_ids=[rank])
                t0 = time.perf_counter()
                payload = xport.recv(src=0)
                ms = (time.perf_counter() - t0) * 1e3
                assert core.import_sequence(payload) == rid
                tokens, finish = step_until(core, rid)
                result[rid] = {"tokens": tokens, "finish": finish, "bytes": len(payload), "recv_ms": ms}
        for key, n in (("warm", 1 << 20), ("bulk", BULK)):
            if rank == 0:
                data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
                digest = xxhash.xxh3_64_intdigest(data.cpu().numpy().tobytes())
                torch.cuda.synchronize()
                dist.barrier(device_ids=[rank])
                stats = xport.send(data, dst=1)
                result[key] = {"digest": digest, "ms": stats.ms, "gbps": stats.gb_per_s}
            else:
                dist.barrier(device_ids=[rank])
                got = xport.recv_tensor(src=0)
                assert got.device == torch.device(device) and got.numel() == n
                result[key] = {"digest": xxhash.xxh3_64_intdigest(got.cpu().numpy().tobytes())}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        core.close()
        dist.destroy_process_group()


def test_handoff_over_nccl_equals_one_process(tmp_path) -> None:
    assert pick_transport("cuda:0", "cuda:1", same_host=False, group_backend="nccl") is TransportKind.P2P
    model = str(generate_checkpoint("tiny", tmp_path / "tiny").path)
    want = reference(model, "cuda:0")
    rendezvous = rendezvous_file()
    out = tmp_path / "out"
    out.mkdir()
    try:
        mp.spawn(_worker, args=(rendezvous.path, model, str(out)), nprocs=2, join=True)
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
            f"NCCL cuda:0 -> cuda:1, {rid} (prompt {plen}): {a[rid]['bytes']:,} B, "
            f"send {a[rid]['ms']:.2f} ms, recv {b[rid]['recv_ms']:.2f} ms"
        )
    assert a["bulk"]["digest"] == b["bulk"]["digest"] and a["warm"]["digest"] == b["warm"]["digest"]
    print(f"NCCL cuda:0 -> cuda:1, 1 GiB: {a['bulk']['ms']:.1f} ms ({a['bulk']['gbps']:.1f} GB/s, send)")
