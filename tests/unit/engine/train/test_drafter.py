"""`sluice train drafter`: the MTP layer distilled from its frozen target over chained passes.

The labels follow the acceptance measure's convention (pass ``j`` at ``q`` drafts the target's
token at ``q + 2``), the stage changes only ``mtp.0.*``, and it is deterministic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.train.drafter import CURVE_NAME, JOINT_HEAD, _confidence_start, distillation_losses, train_drafter
from engine.train.evaluate import greedy_chains
from engine.train.model import TrainModel, model_config
from engine.train.settings import DrafterSettings
from engine.train.trainer import Streams

from .small import SMALL, file_sha


def test_labels_are_the_targets_token_after_next_along_a_greedy_chain(built: Path) -> None:
    """On the target's own greedy chain the target's top-1 at ``q + 1`` is the chain's token at
    ``q + 2``, so each pass's agreement must equal its drafts' agreement with the chain: what
    ``mtp_acceptance`` counts. A label one position off (the next token's) fails this."""
    data = Streams(built)
    # index_topk covering every entry: ReLU indexer scores tie at 0, and topk breaks ties by layout
    shape = {**SMALL, "index_topk": 64, "dtype": "float32"}
    model = TrainModel(model_config(data.vocab_size, data.bos, data.eos, **shape), seed=5)
    with torch.no_grad():  # off the init, so the target's top-1 varies from position to position
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    model.indexer.enabled = False
    depth = 3
    with torch.no_grad():
        chain = greedy_chains(model, torch.tensor([[data.bos], [int(data.train[0])]]), gen_tokens=40)
    # a random drafter agrees nowhere: distil it on the chain until it agrees somewhere
    opt = torch.optim.Adam(model.mtp.parameters(), lr=1e-2)
    for _ in range(30):
        kls, _, _ = distillation_losses(model, chain, depth)
        torch.stack(kls).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        kls, agree, bces = distillation_losses(model, chain, depth)
        assert bces == []  # no head, no confidence loss
        streams, kwargs = model.trunk(chain)
        nxt = torch.cat([chain[:, 1:], chain[:, -1:]], dim=1)
        n = chain.shape[1]
        for j, hidden in enumerate(model.draft_passes(streams, nxt, kwargs, depth), start=1):
            drafts = model.mtp_logits(hidden).argmax(dim=-1)[:, j - 1 : n - 2]  # q = j-1 .. n-3
            want = drafts == chain[:, j + 1 : n]  # the chain's token at q + 2
            assert torch.equal(agree[j - 1][:, :-1], want), j
            assert float(want.float().mean()) > 0.2
            assert not torch.equal(want, drafts == chain[:, j : n - 1])  # a label one token early would fail
            assert float(kls[j - 1]) > 0.0


def test_the_stage_trains_only_the_drafter_deterministically(
    built: Path, trained: Path, tmp_path: Path
) -> None:
    s = DrafterSettings(steps=3, warmup=1, seq_len=64, batch=2, depth=3, accept_prompts=4, lr=1e-3)
    base_sha = file_sha(trained / "model.safetensors")
    a = train_drafter(trained, built, tmp_path / "a", s)
    b = train_drafter(trained, built, tmp_path / "b", s)
    assert file_sha(trained / "model.safetensors") == base_sha  # the input is read, never rewritten
    assert file_sha(tmp_path / "a" / "model.safetensors") == file_sha(tmp_path / "b" / "model.safetensors")
    base = load_file(str(trained / "model.safetensors"))
    out = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert set(out) == set(base)
    assert all(torch.equal(out[k], base[k]) for k in base if not k.startswith("mtp."))  # the target
    assert not all(torch.equal(out[k], base[k]) for k in base if k.startswith("mtp."))  # it trained
    # the target is untouched, so it scores the held-out text exactly as the base did
    assert a["heldout"]["ppl"] == pytest.approx(
        json.loads((trained / "training.json").read_text())["heldout"]["ppl"], rel=1e-3
    )
    info = json.loads((tmp_path / "a" / "training.json").read_text())
    assert info == json.loads(json.dumps(a)) and a["mtp_acceptance"] == b["mtp_acceptance"]
    assert info["stage"] == "drafter" and info["base"]["model_safetensors_sha256"] == base_sha
    steps = [json.loads(line) for line in (tmp_path / "a" / CURVE_NAME).read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(len(r["kl"]) == 3 for r in steps)
    with pytest.raises(ValueError, match="must differ"):
        train_drafter(trained, built, trained, s)


def test_a_confidence_head_trained_beside_it_reaches_the_drafter(built: Path) -> None:
    """``distillation_losses`` with a head: one BCE per pass of the head's logit on ``[h ; e]``
    (``h`` what ``lm_head`` reads, ``e`` the fed token's embedding) against the pass's
    agreement, and its gradient reaches the MTP layer (so that ``h`` learns to carry it)."""
    data = Streams(built)
    model = TrainModel(
        model_config(data.vocab_size, data.bos, data.eos, **{**SMALL, "dtype": "float32"}), seed=5
    )
    model.indexer.enabled = False
    ids = torch.tensor([[data.bos, *(int(t) for t in data.train[:23])]])
    width = 2 * model.hf_cfg.hidden_size
    head = torch.nn.Linear(width, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    _, agree, bces = distillation_losses(model, ids, 2, head)
    assert len(bces) == 2 and all(
        float(b.detach()) == pytest.approx(float(torch.log(torch.tensor(2.0)))) for b in bces
    )
    torch.nn.init.normal_(head.weight, std=0.1)  # a zero head passes no gradient to h
    model.mtp.zero_grad()
    _, _, bces = distillation_losses(model, ids, 2, head)
    torch.stack(bces).mean().backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.mtp.parameters())


def test_the_confidence_weight_changes_the_drafter_and_is_logged(
    built: Path, trained: Path, tmp_path: Path
) -> None:
    s = DrafterSettings(steps=3, warmup=1, seq_len=64, batch=2, depth=3, accept_prompts=4, lr=1e-3)
    train_drafter(trained, built, tmp_path / "plain", s)
    train_drafter(trained, built, tmp_path / "joint", dataclasses.replace(s, confidence_weight=1.0))
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    joint = load_file(str(tmp_path / "joint" / "model.safetensors"))
    assert all(torch.equal(plain[k], joint[k]) for k in plain if not k.startswith("mtp."))
    assert not all(torch.equal(plain[k], joint[k]) for k in plain if k.startswith("mtp."))
    steps = [json.loads(line) for line in (tmp_path / "joint" / CURVE_NAME).read_text().splitlines()]
    assert all(len(r["bce"]) == 3 for r in steps)
    assert "bce" not in json.loads((tmp_path / "plain" / CURVE_NAME).read_text().splitlines()[0])
    # the head beside the drafter is kept apart, for a continuation, and never as the engine's
    kept = load_file(str(tmp_path / "joint" / JOINT_HEAD))
    assert (
        set(kept) == {"confidence.weight", "confidence.bias"}
        and float(kept["confidence.weight"].abs().sum()) > 0
    )
    assert json.loads((tmp_path / "joint" / "training.json").read_text())["joint_head"] == JOINT_HEAD
    assert not (tmp_path / "plain" / JOINT_HEAD).exists() and not (tmp_path / "joint" / "confidence").exists()
    resumed = _confidence_start(str(tmp_path / "joint" / JOINT_HEAD), kept["confidence.weight"].shape[1])
    assert torch.equal(resumed.weight.detach(), kept["confidence.weight"])
    with pytest.raises(ValueError, match="confidence_weight"):
        DrafterSettings(confidence_weight=-1.0).validate()


def test_the_head_beside_the_drafter_starts_from_a_fitted_head(tmp_path: Path) -> None:
    """``confidence_from`` loads a checkpoint's shipped head (exact weights, its width checked);
    without it the head starts at zero; a source without a head, or without the head's loss,
    is refused."""
    from safetensors.torch import save_file

    assert float(_confidence_start("", 8).weight.detach().abs().sum()) == 0.0
    (tmp_path / "confidence").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    w, b = torch.randn(1, 8), torch.randn(1)
    save_file(
        {"confidence.weight": w, "confidence.bias": b}, str(tmp_path / "confidence" / "model.safetensors")
    )
    head = _confidence_start(str(tmp_path), 8)
    assert torch.equal(head.weight.detach(), w) and torch.equal(head.bias.detach(), b)
    with pytest.raises(ValueError, match="inputs"):
        _confidence_start(str(tmp_path), 16)
    with pytest.raises(ValueError, match="no confidence"):
        _confidence_start(str(tmp_path / "confidence"), 8)
    with pytest.raises(ValueError, match="no file"):
        _confidence_start(str(tmp_path / "missing.safetensors"), 8)
    save_file({"other": w}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not confidence.weight"):
        _confidence_start(str(tmp_path / "other.safetensors"), 8)
    with pytest.raises(ValueError, match="confidence_from needs"):
        DrafterSettings(confidence_from=str(tmp_path)).validate()
    DrafterSettings(confidence_from=str(tmp_path), confidence_weight=1.0).validate()


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        DrafterSettings(seq_len=4, depth=5).validate()
    with pytest.raises(ValueError):
        DrafterSettings(steps=4, warmup=4).validate()
    s = DrafterSettings(steps=10, warmup=2, lr=1.0, min_lr_ratio=0.1)
    assert [round(s.lr_at(i), 6) for i in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 0.1]
