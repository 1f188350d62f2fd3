"""``sluice train data`` end to end on a tiny tree, and against a manifest."""

from __future__ import annotations

import json

import pytest

from engine.train.corpus import Manifest
from engine.train.data import read_array
from services.cli import main


def test_data_stage_writes_everything(built):
    names = {p.name for p in built.iterdir()}
    assert names >= {
        "manifest.json",
        "split.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train.bin",
        "heldout.bin",
        "data.json",
    }
    header = json.loads((built / "data.json").read_text())
    assert header["split"] == "heldout-v1" and header["dtype"] == "<u2"
    manifest = Manifest.read(built / "manifest.json")
    assert header["corpus"]["digest"] == manifest.digest
    split = json.loads((built / "split.json").read_text())
    assert set(split["train"]).isdisjoint(split["heldout"])
    train = read_array(built, "train")
    files = header["arrays"]["train"]["files"]
    assert [f["path"] for f in files] == split["train"]
    assert sum(f["n_tokens"] for f in files) == len(train) == header["arrays"]["train"]["n_tokens"]
    eos = header["tokenizer"]["eos"]
    assert all(train[f["offset"] + f["n_tokens"] - 1] == eos for f in files)
    assert set(header["heldout_tokens_per_byte"]) == {"full", "1024", "2048", "4096", "8192"}


def test_data_stage_refuses_a_tree_that_differs_from_the_manifest(built, subset_tree, tmp_path, capsys):
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(subset_tree, tree)
    (tree / "bisect.py").write_text("changed\n")
    rc = main(
        [
            "train",
            "data",
            "--out",
            str(tmp_path / "o"),
            "--root",
            str(tree),
            "--manifest",
            str(built / "manifest.json"),
        ]
    )
    assert rc == 2
    assert "differ: bisect.py" in capsys.readouterr().err


def test_no_model_stage_yet():
    with pytest.raises(SystemExit):
        main(["train", "model"])


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_model_and_eval_stages_through_the_cli(built, tmp_path, capsys):
    """The shipped shape, one tiny step on the CPU, then its stored weights scored again."""
    out = tmp_path / "model"
    args = ["--data", str(built), "--out", str(out), "--seq-len", "64", "--batch", "2", "--micro-batch", "2"]
    args += ["--steps", "1", "--warmup", "0", "--eval-windows", "1", "--accept-prompts", "2"]
    assert main(["train", "model", *args]) == 0
    printed = capsys.readouterr().out
    assert "heldout-v1 perplexity" in printed and "MTP acceptance at positions 1-5" in printed
    info = json.loads((out / "training.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 8 and cfg["sliding_window"] == 128  # the shipped shape
    assert info["attention"] == "sluice_windowed" and info["settings"]["steps"] == 1
    argv = ["train", "eval", "--model", str(out), "--data", str(built), "--seq-len", "64"]
    assert main([*argv, "--accept-prompts", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # stored bf16 weights score within a hair of the fp32 weights the run ended with
    assert report["heldout"]["ppl"] == pytest.approx(info["heldout"]["ppl"], rel=0.01)
    assert report["heldout"]["tokens"] == info["heldout"]["tokens"]


def test_model_overrides_parse_as_json_or_plain_strings():
    import pytest

    from services.commands.train import parse_overrides

    got = parse_overrides(["moe_intermediate_size=80", 'layer_types=["a", "b"]', "note=plain text"])
    assert got == {"moe_intermediate_size": 80, "layer_types": ["a", "b"], "note": "plain text"}
    assert parse_overrides([]) == {}
    with pytest.raises(ValueError, match="KEY=JSON"):
        parse_overrides(["no-equals-sign"])
