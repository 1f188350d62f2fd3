"""`sluice train model` on a shrunken shape: the checkpoint it writes is what transformers and the
engine read (MTP included), training is deterministic, and each loss reaches what it trains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint.presets import CSA, HCA, SLIDING
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from engine.train.evaluate import prompt_offsets, windows
from engine.train.model import SHAPE, TrainModel, export_state, load_trained, model_config
from engine.train.trainer import Streams, TrainSettings, batches, lr_at, train, write_checkpoint

from .small import SETTINGS, SMALL, file_sha


def test_shipped_shape_has_every_layer_kind_and_a_selective_indexer() -> None:
    cfg = model_config(8192, 0, 1)
    assert {SLIDING, CSA, HCA} <= set(cfg["layer_types"]) and cfg["num_hidden_layers"] >= 8
    assert cfg["mlp_layer_types"][0] == "hash_moe" and cfg["mlp_layer_types"][-1] == "moe"
    assert cfg["sliding_window"] == 128
    assert cfg["index_topk"] < 4096 // cfg.get("compress_rates", {CSA: 4})[CSA]
    assert cfg["rope_parameters"]["original_max_position_embeddings"] == TrainSettings().seq_len
    assert SHAPE["num_nextn_predict_layers"] == 1


def test_checkpoint_has_the_generators_tensors_and_loads_in_transformers(trained: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    from engine.checkpoint.generate import _plan_shapes

    cfg = json.loads((trained / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(trained / "model.safetensors", "pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    # The generator copies the last layer's keys for the MTP layer, a CSA layer's compressor too,
    # which the engine's sliding-window MTP layer never reads; the trained export leaves it out.
    plans = {
        p.name: (p.shape, p.dtype)
        for p in _plan_shapes(cfg)
        if not p.name.startswith("mtp.0.self_attn.compressor.")
    }
    assert set(got) == set(plans)
    for name, (shape, dtype) in plans.items():
        assert got[name][0] == shape, name
        assert got[name][1] == {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[dtype], name
    model = DeepseekV4ForCausalLM.from_pretrained(trained)
    logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert torch.isfinite(logits).all()
    info = json.loads((trained / "training.json").read_text())
    assert info["settings"]["steps"] == SETTINGS.steps and info["heldout"]["tokens"] > 0
    assert len((trained / "curve.jsonl").read_text().splitlines()) == SETTINGS.steps + 2  # 2 valid points


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_training_is_deterministic_for_a_seed(built: Path, trained: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    train(built, again, SETTINGS, model_overrides=SMALL)
    assert file_sha(again / "model.safetensors") == file_sha(trained / "model.safetensors")
    other = tmp_path / "other"
    train(built, other, TrainSettings(**{**SETTINGS.__dict__, "seed": 1}), model_overrides=SMALL)
    assert file_sha(other / "model.safetensors") != file_sha(trained / "model.safetensors")


def test_engine_main_and_mtp_logits_equal_the_training_model(built: Path, tmp_path: Path) -> None:
    """The exported ``mtp.0.*`` is the engine's MTP layer: same draft logits at every position (fp32)."""
    data = Streams(built)
    # index_topk covers every entry here: ReLU indexer scores tie at exactly 0, and torch.topk breaks
    # ties differently in the engine's and transformers' layouts (a reference quirk, not the export's).
    shape = {**SMALL, "index_topk": 64, "dtype": "float32"}
    model = TrainModel(model_config(data.vocab_size, data.bos, data.eos, **shape), seed=3)
    with torch.no_grad():  # move every parameter off its init, so a mis-mapped tensor shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()
    info = {"settings": {"seed": 3}}
    write_checkpoint(model, tmp_path, built, info)
    ids = data.heldout[:90].tolist()
    nxt = ids[1:] + [data.eos]
    with torch.no_grad():
        streams, kwargs = model.trunk(torch.tensor([ids]))
        want_main = model.main_logits(streams)[0]
        want_mtp = model.mtp_logits(model.mtp_streams(streams, torch.tensor([nxt]), kwargs))[0]
    runner = ModelRunner(tmp_path, RunnerConfig(num_blocks=2, num_slots=1))
    pos = 0
    for chunk in (37, 1, 52):
        batch = ForwardBatch.from_sequences([SequenceInput(ids[pos : pos + chunk], pos, 0, [0, 1])])
        out = runner.execute(batch)
        draft, _ = runner.draft(out.hidden, torch.tensor(nxt[pos : pos + chunk]), batch)
        pos += chunk
        assert (out.logits[0] - want_main[pos - 1]).abs().max().item() < 1e-4, ("main", pos)
        assert (draft[0] - want_mtp[pos - 1]).abs().max().item() < 1e-4, ("mtp", pos)


def test_each_loss_trains_its_parts(built: Path) -> None:
    data = Streams(built)
    model = TrainModel(model_config(data.vocab_size, data.bos, data.eos, **SMALL), seed=0)
    y = torch.from_numpy(data.train[:129].reshape(1, -1)[:, :128].copy())
    x = torch.cat([torch.full_like(y[:, :1], data.bos), y[:, :-1]], dim=1)
    losses = model(x, y)
    assert losses["indexer"].item() > 0
    losses["indexer"].backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(".indexer." in n for n in with_grad)  # distillation moves the indexer alone
    model.zero_grad()
    losses = model(x, y)
    (losses["lm"] + losses["mtp"]).backward()
    idx = [p for n, p in model.named_parameters() if ".indexer." in n]
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in idx)  # top-k carries no gradient
    assert model.mtp.e_proj.weight.grad.abs().sum() > 0
    before = [r.e_score_correction_bias.clone() for r in model.balancer.routers]
    worst = model.balancer.update()
    assert worst >= 1.0
    assert any(not torch.equal(b, r.e_score_correction_bias) for b, r in zip(before, model.balancer.routers))


def test_windowed_attention_equals_transformers_eager(built: Path) -> None:
    """Chunked queries over their window and the compressed entries: eager's losses and gradients."""
    import engine.train.attention as tm

    data = Streams(built)
    cfg = model_config(data.vocab_size, data.bos, data.eos, **{**SMALL, "index_topk": 8})
    eager = TrainModel(cfg, seed=0, attention="eager")
    windowed = TrainModel(cfg, seed=0)
    windowed.load_state_dict(eager.state_dict())
    y = torch.from_numpy(data.train[:300].reshape(1, -1).copy())
    x = torch.cat([torch.full_like(y[:, :1], data.bos), y[:, :-1]], dim=1)
    chunk, tm._QUERY_CHUNK = tm._QUERY_CHUNK, 64  # several chunks, each with a window reaching back
    try:
        want, got = eager(x, y), windowed(x, y)
        sum(want.values()).backward()
        sum(got.values()).backward()
    finally:
        tm._QUERY_CHUNK = chunk
    for k in want:
        assert abs(want[k].item() - got[k].item()) < 1e-5, k
    grads = dict(eager.named_parameters())
    for name, p in windowed.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4), name


def test_hash_tables_are_random_distinct_and_seeded() -> None:
    cfg = model_config(1024, 0, 1, **SMALL)
    a, b = TrainModel(cfg, seed=0), TrainModel(cfg, seed=1)
    ta = next(buf for n, buf in a.named_buffers() if n.endswith("tid2eid"))
    tb = next(buf for n, buf in b.named_buffers() if n.endswith("tid2eid"))
    assert not torch.equal(ta, tb) and len(set(ta[:, 0].tolist())) == cfg["n_routed_experts"]
    assert (ta[:, 0] != ta[:, 1]).all()


def test_load_trained_round_trips_the_checkpoint(trained: Path) -> None:
    model = load_trained(trained)
    state = export_state(model)
    from safetensors.torch import load_file

    stored = load_file(str(trained / "model.safetensors"))
    assert set(state) == set(stored)
    assert all(torch.equal(state[k], stored[k]) for k in stored)


@pytest.mark.parametrize("n,seq", [(1, 8), (7, 8), (8, 8), (100, 8), (4097, 4096), (10, 2)])
def test_windows_score_every_token_once_with_half_a_window_of_context(n: int, seq: int) -> None:
    scored = np.zeros(n, dtype=int)
    for start, end, first in windows(n, seq):
        assert end - start <= seq and start <= first <= end
        assert first == 0 or first - start >= seq // 2
        scored[first:end] += 1
    assert (scored == 1).all()


def test_batches_are_seeded_and_cover_each_epoch() -> None:
    stream = np.arange(1000)
    s = TrainSettings(seq_len=10, batch=4, micro_batch=2, steps=30, warmup=3)
    a = [y for y, _ in batches(stream, s)]
    b = [y for y, _ in batches(stream, s)]
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    rows = np.concatenate(a)
    assert rows.shape == (120, 10) and (np.diff(rows, axis=1) == 1).all()  # contiguous windows
    first_epoch = {int(r[0]) for r in rows[:99]}
    assert len(first_epoch) == 99  # one epoch visits its 99 windows once each
    assert lr_at(0, s) < lr_at(1, s) < lr_at(2, s) == s.lr and lr_at(s.steps - 1, s) == pytest.approx(
        s.lr * s.min_lr_ratio
    )


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        TrainSettings(batch=5, micro_batch=2).validate()
    with pytest.raises(ValueError, match="warmup"):
        TrainSettings(steps=4, warmup=4).validate()
    assert prompt_offsets(1000, 4, 100) == [0, 224, 449, 674]


@pytest.mark.slow  # two more training runs each: make test keeps the module's one
def test_a_run_split_by_stop_and_resume_equals_one_run(built: Path, trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    assert train(built, out, SETTINGS, model_overrides=SMALL, stop_after=2) is None
    assert not (out / "model.safetensors").exists() and (out / "state" / "state.json").is_file()
    info = train(built, out, SETTINGS, model_overrides=SMALL, resume=True)
    assert info is not None and info["final_step"]["step"] == SETTINGS.steps
    assert not (out / "state").exists()  # nothing left to resume
    assert file_sha(out / "model.safetensors") == file_sha(trained / "model.safetensors")
    strip = [
        {k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
        for line in (out / "curve.jsonl").open()
    ]
    want = [
        {k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
        for line in (trained / "curve.jsonl").open()
    ]
    assert strip == want
    with pytest.raises(ValueError, match="nothing to resume"):
        train(built, out, SETTINGS, model_overrides=SMALL, resume=True)
    assert train(built, out, SETTINGS, model_overrides=SMALL, stop_after=1) is None
    other = TrainSettings(**{**SETTINGS.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="other settings"):
        train(built, out, other, model_overrides=SMALL, resume=True)


def test_unlikelihood_penalises_recent_tokens_other_than_the_target() -> None:
    from engine.train.model import unlikelihood

    torch.manual_seed(0)
    y = torch.tensor([[5, 6, 5, 7]])
    logits = torch.randn(1, 4, 10, requires_grad=True)
    ul = unlikelihood(logits, y, window=2)
    p = logits.detach().softmax(-1)[0]
    # position 1: {5}; 2: {5, 6} minus the target 5 -> {6}; 3: {6, 5}; position 0 has no context
    want = (
        -(torch.log1p(-p[1, 5]) + torch.log1p(-p[2, 6]) + torch.log1p(-p[3, 6]) + torch.log1p(-p[3, 5])) / 4
    )
    assert float(ul.detach()) == pytest.approx(float(want), rel=1e-6)
    ul.backward()
    g = logits.grad[0]
    assert float(g[1, 5]) > 0 and float(g[3, 7]) < 0  # a candidate is pushed down, the target's share rises
    assert unlikelihood(logits.detach(), y, window=1) < ul.detach()  # a narrower window, fewer candidates


@pytest.mark.slow  # two more training runs each: make test keeps the module's one
def test_unlikelihood_stage_is_deterministic_keeps_the_base_and_records_it(
    built: Path, trained: Path, tmp_path: Path
) -> None:
    from engine.train.unlikelihood import CURVE_NAME, UnlikelihoodSettings, train_unlikelihood

    s = UnlikelihoodSettings(steps=3, warmup=1, seq_len=64, batch=4, micro_batch=2, accept_prompts=4, lr=1e-3)
    base_sha = file_sha(trained / "model.safetensors")
    a = train_unlikelihood(trained, built, tmp_path / "a", s)
    b = train_unlikelihood(trained, built, tmp_path / "b", s)
    assert file_sha(trained / "model.safetensors") == base_sha  # the base is read, never rewritten
    assert file_sha(tmp_path / "a" / "model.safetensors") == file_sha(tmp_path / "b" / "model.safetensors")
    assert file_sha(tmp_path / "a" / "model.safetensors") != base_sha  # it trained
    info = json.loads((tmp_path / "a" / "training.json").read_text())
    assert info == json.loads(json.dumps(a)) and a["heldout"] == b["heldout"]
    assert info["base"]["model_safetensors_sha256"] == base_sha
    assert info["base"]["training"]["settings"]["steps"] == SETTINGS.steps
    assert info["stage"] == "unlikelihood" and info["settings"]["alpha"] == s.alpha
    steps = [json.loads(line) for line in (tmp_path / "a" / CURVE_NAME).read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["ul"] > 0 for r in steps)
    assert (tmp_path / "a" / "curve.jsonl").read_text() == (trained / "curve.jsonl").read_text()
    load_trained(tmp_path / "a")  # the checkpoint loads like a model stage's
    with pytest.raises(ValueError, match="must differ"):
        train_unlikelihood(trained, built, trained, s)
