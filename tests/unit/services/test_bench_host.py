"""``sluice bench host``: the host's share of a decode step, the forward stubbed."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import host


def test_the_host_share_is_measured_per_batch() -> None:
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    out = json.loads(
        json.dumps(host.run(p.parse_args(["--batches", "1,8", "--steps", "5", "--warmup", "1"])).to_json())
    )
    res = out["results"]
    assert set(res) == {"1", "8"}
    assert all(r["ms_per_step"] > 0 and r["us_per_sequence"] > 0 for r in res.values())
    assert res["8"]["us_per_sequence"] == res["8"]["ms_per_step"] * 1e3 / 8
    # the argmax over the step's rows, timed alone: device work on a GPU, taken out of the host's share
    assert all(r["argmax_ms"] > 0 for r in res.values())
    assert res["8"]["us_per_sequence_without_argmax"] == pytest.approx(
        (res["8"]["ms_per_step"] - res["8"]["argmax_ms"]) * 1e3 / 8
    )


def test_speculating_steps_are_timed_with_the_drafts_accepted_as_asked() -> None:
    """The stubs steer every step: each request accepts ``--accept`` of its drafts (the bench
    raises otherwise), and the engine's own counters say so."""
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    args = p.parse_args(
        ["--batches", "4", "--steps", "4", "--warmup", "1", "--speculative", "fixed-3", "--accept", "2"]
    )
    out = host.run(args).to_json()
    assert out["config"]["speculative"] == "fixed-3" and out["config"]["accept"] == 2
    assert out["results"]["4"]["ms_per_step"] > 0


def test_a_speculative_setting_other_than_fixed_k_is_refused() -> None:
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    with pytest.raises(SystemExit, match="fixed-K"):
        host.run(p.parse_args(["--batches", "1", "--steps", "1", "--speculative", "dspark"]))


def test_phases_are_timed_in_the_timed_steps_and_the_methods_put_back() -> None:
    import inspect

    from engine.spec.speculation import Speculation

    stage = inspect.getattr_static(Speculation, "stage")
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    args = p.parse_args(
        ["--batches", "4", "--steps", "3", "--warmup", "1", "--speculative", "fixed-2", "--phases"]
    )
    phases = host.run(args).to_json()["results"]["4"]["phases_ms"]
    assert list(phases) == [f"{cls}.{name}" for _, cls, name in host.PHASES]
    assert all(phases[k] > 0 for k in ("ModelExecutor.launch", "Speculation.stage", "Speculation.draft"))
    assert phases["Speculation.stage"] <= phases["ModelExecutor.launch"]  # timed inside its caller
    assert inspect.getattr_static(Speculation, "stage") is stage  # the engine's own methods again
