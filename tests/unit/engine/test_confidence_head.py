"""The MTP drafts' confidence head: its formula, its file, the training stage that fits it, and
the head shipped with ``models/trained`` (better than a constant predictor on held-out drafts)."""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.confidence import (
    CONFIDENCE_REPORT,
    CONFIDENCE_WEIGHTS,
    ConfidenceConfig,
    ConfidenceHead,
    load_confidence_head,
    mtp_head_inputs,
    softmax_features,
)
from engine.runner import ModelRunner, RunnerConfig
from engine.train.calibration import auc, calibration
from engine.train.confidence import (
    ConfidenceSettings,
    Examples,
    draft_examples,
    fit_head,
    make_chains,
    predict,
    prompt_rows,
    train_confidence,
    write_head,
)
from engine.train.model import TrainModel, load_trained, model_config
from engine.train.trainer import Streams, write_checkpoint
from tests.unit.engine.train.conftest import copy_subset
from tests.unit.engine.train.small import SMALL

ROOT = Path(__file__).resolve().parents[3]
TRAINED = ROOT / "models" / "trained"
TINY = ConfidenceSettings(
    prompts=8, eval_prompts=4, prompt_len=24, gen_tokens=16, micro_batch=4, epochs=8, batch=32, lr=3e-2
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_head(model_dir: Path, hidden: int, state: dict[str, torch.Tensor]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    (model_dir / "confidence").mkdir(exist_ok=True)
    save_file(state, str(model_dir / CONFIDENCE_WEIGHTS))


# -- the head ---------------------------------------------------------------------------------


def test_head_is_sigmoid_of_a_linear_map_of_h_then_e() -> None:
    head = ConfidenceHead(ConfidenceConfig(hidden_size=2))
    with torch.no_grad():
        head.confidence.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
        head.confidence.bias.fill_(-1.0)
    h, e = torch.tensor([0.5, 1.0]), torch.tensor([2.0, -1.0])
    # 1*0.5 - 2*1 + 0.5*2 + 3*(-1) - 1 = -4.5
    assert head(h, e, logit=True).item() == pytest.approx(-4.5)
    assert head(h, e).item() == pytest.approx(1 / (1 + math.exp(4.5)), rel=1e-6)
    # h first, then e: swapped, [2, -1, 0.5, 1] gives 2 + 2 + 0.25 + 3 - 1 = 6.25
    assert head(e, h).item() == pytest.approx(1 / (1 + math.exp(-6.25)), rel=1e-6)
    batch = head(torch.stack([h, e]), torch.stack([e, h]))
    assert batch.shape == (2,) and batch.dtype == torch.float32
    with pytest.raises(ValueError, match="must both be"):
        head(torch.zeros(3), torch.zeros(3))


def test_load_returns_none_without_the_file_and_checks_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2}))
    assert load_confidence_head(tmp_path) is None
    w, b = torch.tensor([[1.0, -2.0, 0.5, 3.0]]), torch.tensor([-1.0])
    _write_head(tmp_path, 2, {"confidence.weight": w, "confidence.bias": b})
    head = load_confidence_head(tmp_path, dtype=torch.float64)
    assert head is not None and not head.training
    assert head.confidence.weight.dtype == torch.float64
    assert torch.equal(head.confidence.weight.float(), w) and torch.equal(head.confidence.bias.float(), b)
    assert head(torch.tensor([0.5, 1.0]), torch.tensor([2.0, -1.0])).item() == pytest.approx(
        1 / (1 + math.exp(4.5)), rel=1e-6
    )
    _write_head(tmp_path, 2, {"confidence.weight": w[:, :3], "confidence.bias": b})
    with pytest.raises(ValueError, match="shape"):
        load_confidence_head(tmp_path)
    _write_head(tmp_path, 2, {"confidence.weight": w})
    with pytest.raises(ValueError, match="expected"):
        load_confidence_head(tmp_path)
    _write_head(tmp_path, 3, {"confidence.weight": w, "confidence.bias": b})  # config says D = 3
    with pytest.raises(ValueError, match="shape"):
        load_confidence_head(tmp_path)


def test_softmax_features_of_a_known_distribution() -> None:
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    f = softmax_features(torch.log(p) + 3.0)  # logits up to a constant
    entropy = -(p * p.log()).sum()
    assert f.tolist() == pytest.approx([math.log(0.5), math.log(2.0), float(entropy)], rel=1e-6)
    assert softmax_features(torch.zeros(2, 3, 7)).shape == (2, 3, 3)


def test_a_head_reading_the_softmax_and_position_adds_them_in_that_order() -> None:
    cfg = ConfidenceConfig(hidden_size=2, softmax=True, positions=3)
    assert (cfg.linear_width, cfg.width, cfg.inputs) == (7, 10, "h,e,softmax,position")
    head = ConfidenceHead(cfg)
    with torch.no_grad():
        head.confidence.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 3.0, 2.0, -1.0, 0.25]]))
        head.confidence.bias.fill_(-1.0)
        head.position_bias.copy_(torch.tensor([0.5, 0.0, -3.0]))
    h, e = torch.tensor([0.5, 1.0]), torch.tensor([2.0, -1.0])
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    soft = softmax_features(logits)
    base = -4.5 + 2.0 * soft[0].item() - soft[1].item() + 0.25 * soft[2].item()
    for position, bias in ((1, 0.5), (2, 0.0), (3, -3.0)):
        assert head(h, e, logits, position, logit=True).item() == pytest.approx(base + bias, rel=1e-6)
    with pytest.raises(ValueError, match="softmax"):
        head(h, e, None, 1)
    with pytest.raises(ValueError, match="position"):
        head(h, e, logits, 4)
    with pytest.raises(ValueError, match="position"):
        head(h, e, logits)


@pytest.mark.parametrize(
    ("inputs", "positions", "match"),
    [("e,h", 0, "'h,e' then"), ("h,e,position,softmax", 5, "out of order"), ("h,e,position", 0, "both"),
     ("h,e", 5, "both"), ("h,e,logits", 0, "'h,e' then"), ("h,e,softmax,softmax", 0, "'h,e' then")],
)  # fmt: skip
def test_head_inputs_are_checked_when_named(inputs: str, positions: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConfidenceConfig.parse(4, inputs, positions)


def test_the_stage_checks_its_inputs_before_it_runs() -> None:
    ConfidenceSettings(inputs="h,e,softmax,position").validate()  # position: one per draft (depth)
    with pytest.raises(ValueError, match="out of order"):
        ConfidenceSettings(inputs="h,e,position,softmax").validate()


def test_the_files_shapes_say_what_the_head_reads(tmp_path: Path) -> None:
    """A written head loads back as what it was, whatever it reads; a file whose tensors do not
    fit one head form is refused."""
    for cfg in (
        ConfidenceConfig(3),
        ConfidenceConfig(3, softmax=True),
        ConfidenceConfig(3, positions=5),
        ConfidenceConfig(3, softmax=True, positions=4),
    ):
        head = ConfidenceHead(cfg)
        with torch.no_grad():
            head.position_bias.copy_(torch.arange(cfg.positions, dtype=torch.float32))
        out = tmp_path / cfg.inputs.replace(",", "_") / str(cfg.positions)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"hidden_size": 3}))
        write_head(head, out, {})
        back = load_confidence_head(out)
        assert back is not None and back.cfg == cfg
        assert torch.equal(back.position_bias, head.position_bias)
        assert torch.equal(back.confidence.weight, head.confidence.weight)
    w, b = torch.zeros(1, 6), torch.zeros(1)
    _write_head(
        tmp_path / "bad", 3, {"confidence.weight": w, "confidence.bias": b, "confidence.position": w.clone()}
    )
    with pytest.raises(ValueError, match="shape"):  # a position bias must be one row
        load_confidence_head(tmp_path / "bad")
    _write_head(tmp_path / "bad", 3, {"confidence.weight": torch.zeros(1, 8), "confidence.bias": b})
    with pytest.raises(ValueError, match="shape"):  # neither 2D nor 2D + 3 inputs
        load_confidence_head(tmp_path / "bad")


def test_the_fit_learns_a_position_and_softmax_signal_the_h_e_head_cannot_see() -> None:
    """Labels that depend on the draft's position and on its top probability only: the head
    reading them ranks the drafts far better than ``[h ; e]`` of noise, and its position
    biases come out in the labels' order."""
    gen = torch.Generator().manual_seed(0)
    n, d = 4000, 4
    position = torch.randint(1, 6, (n,), generator=gen).numpy()
    soft = torch.randn(n, 3, generator=gen)
    logit = 1.5 * soft[:, 0] - 0.6 * torch.as_tensor(position - 3)
    label = (torch.rand(n, generator=gen) < torch.sigmoid(logit)).numpy().astype(np.float32)
    ex = Examples(
        torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen), soft, position, label, n, []
    )
    settings = ConfidenceSettings(epochs=20, batch=256, lr=3e-2)
    rich = ConfidenceConfig(d, softmax=True, positions=5)
    head, _ = fit_head(ex.inputs(rich), label, settings, cfg=rich)
    plain, _ = fit_head(ex.x, label, settings)
    assert auc(predict(head, ex), label) > auc(predict(plain, ex), label) + 0.15
    assert head.position_bias.tolist() == sorted(head.position_bias.tolist(), reverse=True)
    assert head.confidence.weight[0, 2 * d].item() > 1.0  # log p_max's weight, standardised back
    with pytest.raises(ValueError, match="inputs for a head"):
        fit_head(ex.x, label, settings, cfg=rich)


def test_measures_on_known_cases() -> None:
    y = np.array([0, 0, 1, 1], dtype=np.float64)
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(np.array([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auc(np.array([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    p = np.array([0.15, 0.15, 0.95, 0.95])
    c = calibration(p, y, np.array([1, 1, 1, 2]), 0.5, [0.5, 0.5], bins=10)
    assert c["brier"] == pytest.approx((2 * 0.15**2 + 2 * 0.05**2) / 4)
    assert c["brier_constant_train_rate"] == pytest.approx(0.25)
    assert c["ece"] == pytest.approx(0.5 * 0.15 + 0.5 * 0.05)
    assert [b["n"] for b in c["bins"]] == [0, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    assert c["positions"][1] == pytest.approx(
        {"position": 2, "n": 1, "mean_confidence": 0.95, "observed": 1.0, "brier": 0.05**2,
         "brier_constant": 0.25, "auc": None}
    )  # fmt: skip


# -- the training stage on a tiny checkpoint --------------------------------------------------


# The trunk's output projections (attention and experts) are scaled by this, the MTP layer's zeroed.
TRUNK_SCALE = 0.3
_OUTPUTS = ("self_attn.o_b_proj.weight", "mlp.experts.down_proj", "mlp.shared_experts.down_proj.weight")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 1,024-id data directory of a small stdlib subset, and a test-size checkpoint built (not
    trained) so that its drafts are sometimes accepted: the MTP layer ignores the trunk
    (``h_proj`` 0, ``e_proj`` the identity, its layer's outputs 0, the main norm and hc head), so
    it drafts the target's context-free prediction for the token it is fed; the trunk's layers are
    scaled down, not off, so the target departs from that prediction in some contexts. Random
    weights would have every draft rejected, and nothing to fit."""
    from engine.train.data import Progress, build_data

    tree = copy_subset(tmp_path_factory.mktemp("stdlib-subset"))
    data_dir = tmp_path_factory.mktemp("data")
    build_data(data_dir, root=tree, vocab_size=1024, measure_sizes=(1024,), progress=Progress(io.StringIO()))
    data = Streams(data_dir)
    model = TrainModel(model_config(data.vocab_size, data.bos, data.eos, **SMALL), seed=0).eval()
    mtp: Any = model.mtp
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_OUTPUTS):
                p.mul_(0.0 if name.startswith("mtp.") else TRUNK_SCALE)
        mtp.h_proj.weight.zero_()
        mtp.e_proj.weight.copy_(torch.eye(SMALL["hidden_size"]))
        mtp.norm.weight.copy_(model.lm.model.norm.weight)
        mtp.hc_head.load_state_dict(model.lm.model.hc_head.state_dict())
    model_dir = tmp_path_factory.mktemp("model")
    write_checkpoint(model, model_dir, data_dir, {"settings": {"seed": 0}})
    return data_dir, model_dir


@pytest.mark.slow  # ~10 s of drafting and fitting: `make test-slow`
def test_training_stage_end_to_end_is_deterministic_and_fits(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    data, model = tiny
    before = _sha(model / "model.safetensors")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.__dict__.items()]
    args = ["train", "confidence", "--model", str(model), "--data", str(data), "--out", str(model), *flags]
    assert main(args) == 0
    assert "heldout-v1:" in capsys.readouterr().out
    assert _sha(model / "model.safetensors") == before  # the main weights are never rewritten
    report = json.loads((model / CONFIDENCE_REPORT).read_text())
    fit, held = report["fit"], report["heldout"]
    assert report["model"]["model_safetensors_sha256"] == before
    assert fit["examples"] > 50 and held["n"] > 20
    assert 0.2 < fit["accepted_rate"] < 0.9  # labels of both kinds
    assert fit["epoch_bce"][-1] < fit["initial_bce"] - 0.01  # the loss falls below the constant's
    assert len(held["bins"]) == 10 and sum(b["n"] for b in held["bins"]) == held["n"]
    assert [p["position"] for p in held["positions"]] == [1, 2, 3, 4, 5]
    assert held["positions"][0]["n"] == held["anchors"]  # every anchor's first draft is used
    head = load_confidence_head(model)
    assert head is not None and head.confidence.weight.shape == (1, 2 * SMALL["hidden_size"])

    again = train_confidence(model, data, tmp_path / "again", TINY)  # same seed: the same bytes
    assert (tmp_path / "again" / CONFIDENCE_WEIGHTS).read_bytes() == (model / CONFIDENCE_WEIGHTS).read_bytes()
    assert again["fit"]["epoch_bce"] == fit["epoch_bce"]
    other = tmp_path / "seed1"
    train_confidence(model, data, other, ConfidenceSettings(**{**TINY.__dict__, "seed": 1}))
    assert _sha(other / CONFIDENCE_WEIGHTS) != _sha(model / CONFIDENCE_WEIGHTS)


def test_engine_chains_and_head_inputs_equal_the_training_stages(tiny: tuple[Path, Path]) -> None:
    """The engine's greedy chains are `evaluate.greedy_chains`'; `mtp_head_inputs` on the engine's
    MTP pass gives the (h, e) the head was trained on (draft 1, fp32)."""
    data_dir, model_dir = tiny
    data = Streams(data_dir)
    model = load_trained(model_dir)
    rows = prompt_rows(data.heldout, 3, TINY.prompt_len, data.bos)
    chains = make_chains(rows, TINY.gen_tokens, "engine", model_dir=model_dir)
    assert torch.equal(chains, make_chains(rows, TINY.gen_tokens, "recompute", model=model))
    ex = draft_examples(model, chains[:1], TINY.prompt_len, depth=1)
    chain = chains[0].tolist()
    n = len(chain)
    runner = ModelRunner(model_dir, RunnerConfig(num_blocks=2, num_slots=1))
    # the last anchor t = n - 3: pass 1 at q = t reads streams at t and is fed chain[t + 1]
    t = n - 3
    batch = ForwardBatch.from_sequences([SequenceInput(chain[: t + 1], 0, 0, [0, 1])])
    out = runner.execute(batch)
    next_ids = torch.tensor(chain[1 : t + 2])
    logits, mtp_out = runner.draft(out.hidden, next_ids, batch)
    h, e = mtp_head_inputs(runner.model, mtp_out, next_ids, batch.sample_indices)
    assert (runner.model.lm_head(h).float() - logits).abs().max().item() < 1e-5
    assert (h[0] - ex.h[-1]).abs().max().item() < 1e-4
    assert torch.equal(e[0], ex.e[-1])


# -- the shipped head ---------------------------------------------------------------------------


def test_shipped_head_is_tiny_and_belongs_to_the_shipped_weights() -> None:
    path = TRAINED / CONFIDENCE_WEIGHTS
    assert path.stat().st_size < 4096
    head = load_confidence_head(TRAINED)
    assert head is not None and head.cfg.inputs == "h,e,softmax,position" and head.cfg.positions == 5
    assert sum(p.numel() for p in head.parameters()) == 2 * 256 + 3 + 1 + 5
    report = json.loads((TRAINED / CONFIDENCE_REPORT).read_text())
    assert report["model"]["model_safetensors_sha256"] == _sha(TRAINED / "model.safetensors")
    held = report["heldout"]
    assert held["brier"] < held["brier_constant_train_rate"] and held["auc"] > 0.6


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_shipped_head_beats_a_constant_on_a_held_out_sample() -> None:
    """Drafts along 16 greedy chains from three heldout-v1 stdlib files (tokenised as
    `sluice train data` does): the head's Brier score is below the constant training
    acceptance rate's."""
    from tokenizers import Tokenizer

    from engine.train.corpus import is_heldout, stdlib_root
    from engine.train.vocab import encode_texts

    files = ("operator.py", "runpy.py", "importlib/machinery.py")
    assert all(is_heldout(f) for f in files)
    gen = json.loads((TRAINED / "generation_config.json").read_text())
    tok = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    ids = encode_texts(tok, [(stdlib_root() / f).read_text(encoding="utf-8") for f in files])
    stream = np.array([i for file_ids in ids for i in [*file_ids, gen["eos_token_id"]]], dtype=np.int64)
    model = load_trained(TRAINED)
    head = load_confidence_head(TRAINED)
    assert head is not None
    rows = prompt_rows(stream, 16, 256, gen["bos_token_id"])
    chains = make_chains(rows, 32, "engine", model_dir=TRAINED)
    ex = draft_examples(model, chains, 256, 5)
    rate = json.loads((TRAINED / CONFIDENCE_REPORT).read_text())["fit"]["accepted_rate"]
    p = predict(head, ex)
    brier = float(np.mean((p - ex.label) ** 2))
    constant = float(np.mean((rate - ex.label) ** 2))
    assert len(ex.label) > 500
    assert brier < constant - 0.01, (brier, constant)
