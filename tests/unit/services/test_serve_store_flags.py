"""``sluice serve --store/--device/--dtype``: parsing, validation before anything starts, and
the engine keyword arguments every replica receives (no model is loaded here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import services.api.app
import services.api.inprocess
import services.routing.client
from kvstore.placement import NodeAddress
from kvstore.spec import StoreSpec
from services.cli import build_parser, main
from services.commands import serve


def _spec_file(tmp_path: Path) -> Path:
    nodes = tuple(NodeAddress(f"n{i:02d}", f"127.0.0.1:{7000 + i}") for i in range(12))
    return StoreSpec(nodes, "redis://127.0.0.1:6379/0").save(tmp_path / "spec.json")


def test_flags_parse() -> None:
    args = build_parser().parse_args(["serve", "--store", "local", "--device", "cpu", "--dtype", "bfloat16"])
    assert (args.store, args.device, args.dtype) == ("local", "cpu", "bfloat16")
    args = build_parser().parse_args(["serve"])
    assert (args.store, args.device, args.dtype) == (None, None, None)
    assert serve.engine_kwargs_from(args) == {}  # no flags: the engine gets what it got before


@pytest.mark.parametrize("flag", [["--device", "tpu"], ["--dtype", "float16"]])
def test_bad_choices_are_usage_errors(flag: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *flag])
    assert exc.value.code == 2


def _run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["serve", "--port", "0", "--model", str(tmp_path / "model"), *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_missing_and_bad_spec_exit_2_before_binding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(["--store", str(tmp_path / "absent.json")], tmp_path, capsys)
    assert code == 2 and "absent.json: cannot read it" in out and "listening" not in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": [], "directory": "memory"}))
    code, out = _run(["--store", str(bad)], tmp_path, capsys)
    assert code == 2 and "the spec lists 0" in out and "listening" not in out


def test_cuda_without_cuda_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    code, out = _run(["--device", "cuda"], tmp_path, capsys)
    assert code == 2 and "--device cuda: no CUDA device is available here" in out


class _Captured:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []


@pytest.fixture()
def captured(monkeypatch: pytest.MonkeyPatch) -> _Captured:
    """Engines and the HTTP server replaced: what each engine would be built with."""
    cap = _Captured()

    class FakeEngine:
        def __init__(self, model: Any, **kwargs: Any) -> None:
            cap.calls.append(("single", kwargs))

    def in_process(model: Any, routing: Any, **kwargs: Any) -> FakeEngine:
        cap.calls.append((f"routed x{routing.replicas}", kwargs))
        return FakeEngine.__new__(FakeEngine)

    class FakeApp:
        class state:  # noqa: N801 - mirrors FastAPI's attribute
            class sluice:  # noqa: N801
                class config:  # noqa: N801
                    api_keys = ("k",)

    class FakeServer:
        def __init__(self, *a: Any) -> None:
            pass

        def run(self, sockets: Any) -> None:
            pass

    monkeypatch.setattr(services.api.inprocess, "InProcessEngineClient", FakeEngine)
    monkeypatch.setattr(services.routing.client.RoutedEngineClient, "in_process", staticmethod(in_process))
    monkeypatch.setattr(services.api.app, "create_app", lambda cfg, engine: FakeApp())
    monkeypatch.setattr("uvicorn.Server", FakeServer)
    return cap


def test_engine_kwargs_reach_one_engine_and_every_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], captured: _Captured
) -> None:
    spec = _spec_file(tmp_path)
    code, out = _run(["--store", str(spec), "--device", "cpu", "--dtype", "bfloat16"], tmp_path, capsys)
    assert code == 0, out
    code, out = _run(["--store", str(spec), "--dtype", "float32", "--replicas", "3"], tmp_path, capsys)
    assert code == 0, out
    code, out = _run([], tmp_path, capsys)
    assert code == 0, out
    assert captured.calls == [
        ("single", {"device": "cpu", "dtype": "bfloat16", "kv_store": str(spec)}),
        ("routed x3", {"dtype": "float32", "kv_store": str(spec)}),
        ("single", {}),  # without the flags: exactly as before
    ]


def test_startup_log_names_the_spec_and_its_nodes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], captured: _Captured
) -> None:
    spec = _spec_file(tmp_path)
    with caplog.at_level("INFO", logger="sluice.serve"):
        code, _ = _run(["--store", str(spec)], tmp_path, capsys)
    assert code == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving "))
    assert f"with KV store {spec} (12 nodes, 10+2, directory redis://127.0.0.1:6379/0)" in line


def test_window_state_flags_reach_the_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--swa-replay", "bounded", "--host-swa-mib", "64", "--host-swa-format", "mxfp8",
         "--host-swa-layers", "20", "--batch-invariant"]
    )  # fmt: skip
    assert serve.engine_kwargs_from(args) == {
        "swa_replay": "bounded", "host_swa_bytes": 64 << 20, "host_swa_format": "mxfp8",
        "host_swa_layers": 20, "batch_invariant": True,
    }  # fmt: skip
    fp8 = serve.engine_kwargs_from(build_parser().parse_args(["serve", "--fp8-weights", "w8a8"]))
    assert fp8 == {"keep_quantized": True, "fp8_compute": "w8a8"}
    assert serve.engine_kwargs_from(build_parser().parse_args(["serve", "--fp8-weights", "dequantize"])) == {}
    with pytest.raises(ValueError, match="--host-swa-mib"):
        serve.engine_kwargs_from(build_parser().parse_args(["serve", "--host-swa-mib", "-1"]))


def test_speculation_flags_reach_the_engine_config() -> None:
    """--spec-profile-as-is turns the measured step costs off; without it the engine keeps
    its default (on)."""
    args = build_parser().parse_args(
        ["serve", "--speculative", "dspark", "--spec-profile", "p.json", "--spec-profile-as-is"]
    )
    assert serve.engine_kwargs_from(args) == {
        "speculative": "dspark", "spec_profile_path": "p.json", "spec_measured_costs": False,
    }  # fmt: skip
    plain = serve.engine_kwargs_from(build_parser().parse_args(["serve", "--speculative", "dspark"]))
    assert plain == {"speculative": "dspark"}
