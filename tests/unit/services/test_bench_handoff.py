"""``sluice bench handoff``: the three transports move the same sizes, and the report says so."""

from __future__ import annotations

import json

import pytest

from services.bench.handoff import _size


def test_sizes_parse_with_binary_units() -> None:
    assert [_size(s) for s in ("1KiB", "16MiB", "1GiB", "1000", "1.5MiB")] == [
        1024,
        16 << 20,
        1 << 30,
        1000,
        3 << 19,
    ]


@pytest.mark.integration
def test_bench_handoff_json(ray_local, capsys) -> None:
    from services.cli import main

    assert main(["bench", "handoff", "--json", "--sizes", "64KiB,3MiB", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "handoff" and out["config"]["sizes_bytes"] == [64 << 10, 3 << 20]
    cells = out["results"]["cells"]
    assert [c["bytes"] for c in cells] == [64 << 10, 3 << 20]
    for c in cells:
        for name in ("raw_tcp", "grpc", "ray_object_store"):
            assert c[f"{name} ms"] > 0 and c[f"{name} GB/s"] > 0
        assert c["grpc / raw_tcp"] > 0 and c["ray_object_store / raw_tcp"] > 0


def test_bad_sizes_are_refused(capsys) -> None:
    from services.cli import main

    assert main(["bench", "handoff", "--sizes", "0", "--no-ray"]) == 2
    assert "every size must be >= 1" in capsys.readouterr().err
