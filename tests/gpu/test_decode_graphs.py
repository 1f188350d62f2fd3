"""Decode steps as CUDA graphs (engine/cuda_graphs.py) on the GPU: captured once per bucket,
replayed, and equal to transformers' reference and to the eager path."""

from __future__ import annotations

import gc
import random

import torch

from engine.checkpoint.generate import generate_checkpoint
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.refmodel import build_reference

#: nine rows (batch bucket 10), lengths across window, CSA and HCA closings
PROMPTS, STEPS = [1, 3, 14, 30, 47, 5, 9, 16, 22], 24


def _seqs(vocab: int) -> list[list[int]]:
    return [
        torch.randint(3, vocab, (n + STEPS,), generator=torch.Generator().manual_seed(60 + i)).tolist()
        for i, n in enumerate(PROMPTS)
    ]


def _decode(runner: ModelRunner, seqs: list[list[int]], between=None) -> list[torch.Tensor]:
    """Prefill each prompt, then STEPS decode steps of the whole batch (teacher-forced): logits
    per step. ``between()`` runs after each step."""
    blocks = runner.cfg.num_blocks // len(seqs)
    table = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(seqs))]
    pre = [SequenceInput(s[:p], 0, i, table[i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(pre, device="cuda"))
    out = []
    for t in range(STEPS):
        dec = [SequenceInput([s[p + t]], p + t, i, table[i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
        out.append(runner.execute(ForwardBatch.from_sequences(dec, device="cuda")).logits.float().cpu())
        if between is not None:
            between()
    torch.cuda.synchronize()  # a device-side error surfaces in the test that caused it
    return out


def _runner(path, mode: str, n: int = 9) -> ModelRunner:
    cfg = RunnerConfig(num_blocks=n, num_slots=n, dtype="bfloat16", device="cuda", decode_graphs=mode)
    return ModelRunner(path, cfg)


def test_graphed_decode_against_the_reference_in_bf16(tmp_path) -> None:
    """bf16 against transformers' fp32 reference: the graphs add no error beyond the eager
    bf16 path's own rounding (bar: at most twice its largest logit error, plus 1e-3)."""
    ref = build_reference(tmp_path, "mixed_hc2")
    seqs = _seqs(ref.config.vocab_size)
    graphed = _runner(tmp_path, "auto")
    got = _decode(graphed, seqs)
    assert graphed.graphs is not None and graphed.graphs.captures >= 1
    # and the prefill step's one-token prompt, a decode row beside the others (ModelRunner.split)
    assert graphed.graphs.replays == STEPS + 1
    eager = _decode(_runner(tmp_path, "off"), seqs)
    with torch.no_grad():
        want = [ref(torch.tensor(s)[None], use_cache=False).logits[0].float() for s in seqs]
    err = {"graphs": 0.0, "eager": 0.0}
    agree = {"graphs": 0, "eager": 0}
    for t in range(STEPS):
        for i, p in enumerate(PROMPTS):
            for name, out in (("graphs", got), ("eager", eager)):
                err[name] = max(err[name], (out[t][i] - want[i][p + t]).abs().max().item())
                agree[name] += int(out[t][i].argmax() == want[i][p + t].argmax())
    n = STEPS * len(PROMPTS)
    print(
        f"bf16 vs fp32 reference: max |logit error| graphs {err['graphs']:.4f}, eager {err['eager']:.4f}; "
        f"greedy agreement graphs {agree['graphs'] / n:.3f}, eager {agree['eager'] / n:.3f}"
    )
    assert err["graphs"] <= 2 * err["eager"] + 1e-3


def test_a_graph_replays_the_padded_batch_exactly(tmp_path) -> None:
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    modes = {}
    for mode in ("auto", "padded", "off"):
        runner = _runner(path, mode)
        modes[mode] = _decode(runner, _seqs(runner.model_cfg.vocab_size))
    for t in range(STEPS):
        assert torch.equal(modes["auto"][t], modes["padded"][t]), f"step {t}: graph != padded"
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(modes["auto"], modes["off"]))
    print(f"tiny bf16, graphs vs eager greedy agreement {agree / (STEPS * len(PROMPTS)):.3f}")


def _verify(runner: ModelRunner, seqs: list[list[int]], check_sync: bool = False) -> list[torch.Tensor]:
    """Prefill each prompt, then verification-shaped steps: every row 1 to 6 teacher-forced
    tokens (seeded), logits at each: logits per step. ``check_sync``: every step after the
    first of its shape must not wait for the device."""
    rng = random.Random(7)
    blocks = runner.cfg.num_blocks // len(seqs)
    table = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(seqs))]
    pre = [SequenceInput(s[:p], 0, i, table[i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(pre, device="cuda"))
    done, out, shapes = list(PROMPTS), [], set()
    while all(len(s) - d >= 6 for s, d in zip(seqs, done)):
        rows = []
        for i, s in enumerate(seqs):
            q = rng.choice([1, 2, 3, 4, 5, 6])
            rows.append(SequenceInput(s[done[i] : done[i] + q], done[i], i, table[i], num_logits=q))
            done[i] += q
        batch = ForwardBatch.from_sequences(rows, device="cuda")
        shape = max(batch.query_len_cpu)
        torch.cuda.synchronize()
        if check_sync and shape in shapes:
            torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.execute(batch).logits
        finally:
            torch.cuda.set_sync_debug_mode(0)
        shapes.add(shape)
        out.append(logits.float().cpu())
    torch.cuda.synchronize()
    return out


def test_graphed_verification_replays_the_padded_batch_exactly(tmp_path) -> None:
    """Verification steps (rows of 1 to 6 tokens, packed in a token bucket) as graphs: equal
    bitwise to the padded batch run eagerly, close to the unpadded eager path, and a replay
    never waits for the device."""
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    modes, runners = {}, {}
    for mode in ("auto", "padded", "off"):
        runners[mode] = _runner(path, mode, n=18)
        modes[mode] = _verify(runners[mode], _seqs(runners[mode].model_cfg.vocab_size), mode == "auto")
    graphs = runners["auto"].graphs
    assert graphs is not None and graphs.verify_steps == len(modes["auto"]) >= 3 and graphs.replays >= 3
    for t, (a, b) in enumerate(zip(modes["auto"], modes["padded"])):
        assert torch.equal(a, b), f"step {t}: graph != padded"
    err = max((a - b).abs().max().item() for a, b in zip(modes["auto"], modes["off"]))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(modes["auto"], modes["off"]))
    rows = sum(a.shape[0] for a in modes["auto"])
    print(
        f"tiny bf16 verification, graphs vs eager: max |logit diff| {err:.4f}, greedy agreement {agree / rows:.3f}"
    )
    assert err < 0.1


def test_a_graph_keeps_every_tensor_it_reads(tmp_path) -> None:
    """Tensors made for a capture and read by its replays (row starts, lengths, sample flags)
    live as long as the graph: small allocations between steps, which would take over freed
    blocks, change nothing (seen: a second runner's replay gathering out of bounds)."""
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    seqs = _seqs(_runner(path, "off").model_cfg.vocab_size)
    want = _decode(_runner(path, "padded"), seqs)
    junk: list[torch.Tensor] = []

    def churn() -> None:
        junk.clear()
        junk.extend(torch.full((n,), -(1 << 40), dtype=torch.long, device="cuda") for n in range(1, 2048))

    got = _decode(_runner(path, "auto"), seqs, churn)
    for t in range(STEPS):
        assert torch.equal(got[t], want[t]), f"step {t}"


def test_a_capture_survives_a_dead_runner_freed_by_the_cycle_collector(tmp_path) -> None:
    """A runner left in a reference cycle is freed whenever Python's cycle collector runs;
    its graphs freed during another runner's capture would invalidate that capture (seen:
    `bench spec`'s profile, one engine per cell, at its first capture of batch 32). Capture
    collects first and pauses the collector; here the collector runs inside the capture."""
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    seqs = _seqs(_runner(path, "off").model_cfg.vocab_size)
    want = _decode(_runner(path, "padded"), seqs)
    collecting = gc.isenabled()
    gc.disable()  # the dead runner lives until the collector runs inside the capture below
    try:
        dead = _runner(path, "auto")
        _decode(dead, seqs)
        assert dead.graphs is not None and dead.graphs.captures >= 1
        dead.itself = dead  # type: ignore[attr-defined]  # a cycle: only the collector frees it
        del dead
        runner = _runner(path, "auto")
        forward = runner.model.final_hidden

        def collected_mid_capture(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                gc.collect()
            return forward(*args, **kwargs)

        runner.model.final_hidden = collected_mid_capture  # type: ignore[method-assign]
        got = _decode(runner, seqs)
    finally:
        if collecting:
            gc.enable()
    for t in range(STEPS):
        assert torch.equal(got[t], want[t]), f"step {t}"


def test_decode_steps_never_wait_for_the_device(tmp_path) -> None:
    """Building a decode batch and running it, graphed or eager, never synchronises with the
    GPU: the host can prepare the next step while this one runs."""
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    for mode in ("auto", "off"):
        runner = _runner(path, mode, n=3)
        pre = [SequenceInput(list(range(5, 5 + n)), 0, i, [i]) for i, n in enumerate((3, 20, 40))]
        runner.execute(ForwardBatch.from_sequences(pre, device="cuda"))
        for step in range(3):  # the first graphed step captures (allowed to wait), then replays
            dec = [SequenceInput([7], n + step, i, [i]) for i, n in enumerate((3, 20, 40))]
            torch.cuda.synchronize()
            if step:
                torch.cuda.set_sync_debug_mode("error")
            try:
                runner.execute(ForwardBatch.from_sequences(dec, device="cuda"))
            finally:
                torch.cuda.set_sync_debug_mode(0)


def test_pipelined_launches_never_wait_for_the_device(tmp_path) -> None:
    """Pipelined steps: launching step N+1 while step N is unfinished (its batch, its graph
    replay, its device argmax and draws, the input ids fed from step N) never synchronises,
    so the host finishes step N while the device runs N+1; greedy, drawn and penalised tokens
    equal the synchronous loop's. One greedy request asks for logprobs: its rows' copy to the
    host starts at launch too. The penalised rows' sampling, queued when the previous step
    finishes (`_complete`), never synchronises either."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    prompts = [[5 + (i * 7 + j) % 200 for j in range(10 + 9 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2 if i == 1 else None)
        if i % 2
        else SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(6)
    ]
    # penalised rows (greedy and drawn) are sampled when the previous step finishes, on the device
    params[2] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    params[4] = SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, presence_penalty=0.6)
    got = {}
    for pipe in (False, True):
        llm = LLM(path, device="cuda", dtype="bfloat16", pipeline_steps=pipe, max_num_seqs=8)
        try:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)  # captures the graphs
            ex = llm.core.executor
            launch, checked = ex.launch, []

            def strict(out, prev=None, launch=launch, checked=checked):
                if prev is None:
                    return launch(out, prev)
                checked.append(out.step)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return launch(out, prev)
                finally:
                    torch.cuda.set_sync_debug_mode(0)

            complete, completed = ex._complete, []

            def strict_complete(launched, complete=complete, completed=completed):
                completed.append(launched.out.step)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return complete(launched)
                finally:
                    torch.cuda.set_sync_debug_mode(0)

            ex.launch, ex._complete = strict, strict_complete
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            got[pipe] = [list(o.outputs[0].token_ids) for o in outs]
            assert bool(checked) == pipe and (not pipe or ex.fed_tokens >= 6 * 10) and completed
        finally:
            llm.close()
    assert got[True] == got[False]


def test_flash_widths_bf16_graphs_against_eager(tmp_path) -> None:
    """Two flash-shape layers in bf16: greedy agreement of graphed and eager decode, reported
    (bf16 rounding differs between a padded batch and an exact one; random weights give small
    logit margins), and every graphed logit finite."""
    path = generate_checkpoint("flash-shape", tmp_path / "f", num_hidden_layers=2, n_routed_experts=16).path
    out = {}
    for mode in ("auto", "off"):
        runner = _runner(path, mode)
        out[mode] = _decode(runner, _seqs(runner.model_cfg.vocab_size))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(out["auto"], out["off"])) / (
        STEPS * len(PROMPTS)
    )
    worst = max((a - b).abs().max().item() for a, b in zip(out["auto"], out["off"]))
    print(f"flash-shape bf16, graphs vs eager: greedy agreement {agree:.3f}, max |logit diff| {worst:.4f}")
    assert all(torch.isfinite(a).all() for a in out["auto"])
    assert agree >= 0.9


def test_a_graphed_drafting_chain_counts_the_mtp_load_of_every_pass() -> None:
    """The trained preset's MTP layer after a drafting chain run as a CUDA graph: its MoE load
    counters hold every pass's tokens (the sum is captured with the chain) and equal those of
    the same padded chain run eagerly, expert by expert; a step that drafts nothing leaves none."""
    from tests.unit.engine.spec.drafting import decode_step, prefilled

    wanted = [3, 1, 0]  # drafts after each run (0: only the MTP window)
    loads = {}
    for mode in ("auto", "padded"):
        runner, drafter, seqs = prefilled(mode, seed=3, device="cuda", dtype="bfloat16")
        drafts = drafter.draft(*decode_step(runner, seqs, 0, wanted)).result()
        assert drafter.graphs is not None and drafter.graphs.chains_run == 1
        assert [len(drafts[str(i)].tokens) for i in (0, 1)] == [3, 1]
        assert drafter.graphs.replays == (mode == "auto")  # captured and replayed only there
        k = runner.model_cfg.num_experts_per_tok
        assert int(drafter.load.sum()) == k * (3 + sum(max(0, d - 1) for d in wanted))
        loads[mode] = drafter.load.cpu().clone()
        decode_step(runner, seqs, 1, wanted)  # executed, not drafted from
        assert int(drafter.load.sum()) == 0
    assert torch.equal(loads["auto"], loads["padded"])


def test_a_graphed_drafting_chain_gives_the_heads_confidences_of_the_eager_chain() -> None:
    """The trained preset's confidence head (whatever it reads: the draft distribution and the
    draft's position, for the shipped one) inside a captured drafting chain: the same drafts
    and confidences as the same chain run eagerly."""
    from engine.model.confidence import load_confidence_head
    from tests.unit.engine.spec.drafting import MODEL, decode_step, prefilled

    wanted = [5, 3, 1]
    out_by_mode = {}
    for mode in ("auto", "padded"):
        head = load_confidence_head(MODEL, "cuda")
        runner, drafter, seqs = prefilled(mode, seed=5, head=head, device="cuda", dtype="bfloat16")
        drafts = drafter.draft(*decode_step(runner, seqs, 0, wanted)).result()
        assert drafter.graphs is not None and drafter.graphs.replays == (mode == "auto")
        out_by_mode[mode] = {k: (d.tokens, d.confidence) for k, d in drafts.items()}
    for rid, (tokens, conf) in out_by_mode["padded"].items():
        assert out_by_mode["auto"][rid][0] == tokens and len(tokens) == wanted[int(rid)]
        assert max(abs(a - b) for a, b in zip(out_by_mode["auto"][rid][1], conf)) < 1e-5
