"""Speculative decoding in an expert-parallel group: two gloo ranks of the trained preset,
each an `EngineCore` stepping in `Lockstep`, each with its own requests and its own policy
(rank 0 verifies 3 drafts a step; rank 1 runs DSpark on a steep synthetic profile, so its
drafting depth and selection vary from step to step), and rank 1 runs out of work first.

Their MTP passes differ every step, and the MTP layer's MoE exchanges rows between the ranks,
so the passes are matched (`engine.distributed.lockstep.DraftLockstep`: the group agrees on
the most passes of the step, and each rank makes up the rest with empty ones). The tokens,
greedy and seeded, must be one rank's plain decoding's; the counters must show that both
ranks drafted and accepted, that empty passes were run, and that rank 1 stepped idle while
rank 0 still verified.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.prompts import heldout_prompts
from engine.sampling.params import SamplingParams
from engine.spec.profile import SpecProfile
from tests.ranks import run_ranks

pytestmark = pytest.mark.integration  # ~40 s on 2 cores

MODEL = Path(__file__).resolve().parents[3] / "models" / "trained"
WORLD = 2
POLICIES = ("fixed-3", "dspark")
# rank 0 generates longer than rank 1, so rank 1 idles (empty passes) while rank 0 drafts
TOKENS = (40, 16)


def _requests(rank: int) -> list[tuple[list[int], SamplingParams]]:
    """Three held-out prompts a rank (one sampled with a seed), of varied lengths."""
    prompts = heldout_prompts(MODEL, 2 * 3, 200)[3 * rank : 3 * rank + 3]
    n = TOKENS[rank]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11 + rank, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    ]
    return [(p[: 40 + 70 * i], sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _steep_profile(path: Path) -> None:
    """Verification that gets dear fast with the drafts verified: DSpark selects some."""
    batch = (1, 8, 32, 128)
    secs = tuple(tuple(0.01 * b**0.5 * (1 + 0.6 * k * k) for k in range(6)) for b in batch)
    path.write_text(SpecProfile(batch, tuple(range(6)), secs).to_json())


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from engine.core import EngineCore
    from engine.distributed.lockstep import EPMember, Lockstep
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    # a generous collective timeout: the test shares two cores with whatever else runs
    group = EPMember(rank, WORLD, store_path, timeout_s=60.0).join("cpu")
    try:
        cfg = EngineConfig(
            model=str(MODEL), max_num_seqs=4, num_swa_slots=8, speculative=POLICIES[rank],
            spec_profile_path=str(Path(out_dir) / "steep.json"), spec_measured_costs=False,
            ep_size=WORLD, ep_rank=rank,
        )  # fmt: skip
        core = EngineCore(cfg, ep_group=group)
        lockstep = Lockstep(core, group)
        tokens: dict[str, list[int]] = {}
        for i, (prompt, sp) in enumerate(_requests(rank)):
            core.add(CoreRequest(f"r{rank}-{i}", tuple(prompt), sp))
            tokens[f"r{rank}-{i}"] = []
        idle_while_drafting = 0
        for _ in range(500):  # bounded: ~60 steps are needed
            ready, _ = lockstep.agree(core.will_forward(), False)
            if not ready:  # no rank has work left: all leave together
                break
            idle = not core.will_forward()
            padded = core.executor.speculation.lockstep.padded
            for out in lockstep.step():
                tokens[out.request_id].extend(out.new_token_ids)
            idle_while_drafting += idle and core.executor.speculation.lockstep.padded > padded
        else:
            raise RuntimeError("the group did not finish within 500 steps")
        extra = core.stats().extra
        result = {
            "tokens": tokens,
            "stats": {k: v for k, v in extra.items() if k.startswith("spec_")},
            "padded": core.executor.speculation.lockstep.padded,
            "idle_passes": lockstep.idle_passes,
            "idle_while_drafting": idle_while_drafting,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        core.close()
    finally:
        dist.destroy_process_group()


def test_ep_ranks_speculating_with_their_own_policies_give_plain_decodings_tokens(tmp_path: Path) -> None:
    _steep_profile(tmp_path / "steep.json")
    run_ranks(_worker, WORLD, str(tmp_path), timeout_s=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    plain = LLM(MODEL, max_num_seqs=4)
    try:
        for rank, got in enumerate(ranks):
            prompts, params = zip(*_requests(rank))
            outs = plain.generate(prompt_token_ids=list(prompts), sampling_params=list(params))
            for i, o in enumerate(outs):
                assert got["tokens"][f"r{rank}-{i}"] == list(o.outputs[0].token_ids), (
                    f"rank {rank}, request {i}"
                )
    finally:
        plain.close()
    for rank, got in enumerate(ranks):
        s = got["stats"]
        assert 0 < s["spec_accepted_tokens"] <= s["spec_verified_tokens"], (rank, s)
    assert ranks[0]["padded"] + ranks[1]["padded"] > 0  # the ranks' passes differed
    assert ranks[1]["idle_passes"] > 0 and ranks[1]["idle_while_drafting"] > 0, ranks[1]
