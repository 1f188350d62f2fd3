"""Which of a step's logits rows each sampler reads, planned at launch from the requests'
sampling states (`engine.executor.ModelExecutor`) (torch).

Each sampling sequence has ``num_drafts + 1`` rows, in sequence order (fork children share
their parent's row). Rows drawn together are drawn in one `draw_rows` on the device (`draws`);
a row a sampler reads on the host is copied there in one transfer (`rows_needed`); `pick`
takes such rows out of the step's logits.
"""

from __future__ import annotations

from typing import Any

from engine.forward_batch import long_tensor, upload
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import draw_seed
from engine.scheduler.output import SchedulerOutput
from engine.step_state import SamplingState


def needs_row(states: dict[str, SamplingState], rid: str, verifying: bool) -> bool:
    """Whether sampling ``rid`` reads its logits row on the host: logprobs, or a
    host-dependent request verifying drafts (sampled on the host, in order)."""
    st = states.get(rid)
    if st is None or st.done:
        return False
    return st.params.logprobs is not None or (verifying and st.host_dependent)


def draws(
    out: SchedulerOutput, states: dict[str, SamplingState]
) -> tuple[list[tuple[str, int]], list[int], list[SamplingParams], list[int]]:
    """Every row drawn together (`SamplingState.drawn_together`): (request id, output index),
    its logits row, params and derived seed; verified drafts' positions included: each draw
    depends on its own (seed, index) only, so drawing a position that verification then
    discards consumes nothing. A request whose previous token stopped it may be drawn for
    nothing: `ModelExecutor._sample` returns its stop token."""
    rows: list[int] = []
    keys: list[tuple[str, int]] = []
    params: list[SamplingParams] = []
    seeds: list[int] = []
    row = 0
    for s in out.seqs:
        if not s.sample:
            continue
        # fork children share a plain row (one each); a verifying sequence is its own rows
        for rid in (s.request_id, *(() if s.num_drafts else s.fork_children)):
            st = states.get(rid)
            if st is None or st.done or not st.drawn_together:
                continue
            for j in range(s.num_drafts + 1):
                rows.append(row + j)
                keys.append((rid, s.output_index + j))
                params.append(st.params)
                seeds.append(draw_seed(st.seed, s.output_index + j))
        row += s.num_drafts + 1
    return keys, rows, params, seeds


def rows_needed(out: SchedulerOutput, states: dict[str, SamplingState]) -> list[int]:
    """Every logits row the per-row sampler will read (`needs_row`): on the host. Taken at
    launch: a request the previous step then stops is copied for nothing."""
    need: list[int] = []
    row = 0
    for s in out.seqs:
        if not s.sample:
            continue
        width = s.num_drafts + 1
        if any(needs_row(states, rid, s.num_drafts > 0) for rid in (s.request_id, *s.fork_children)):
            need.extend(range(row, row + width))
        row += width
    return need


def pick(logits: Any, rows: list[int]) -> Any:
    """``logits[rows]`` (the tensor itself when that is every row, in order)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[upload(long_tensor(rows), logits.device)]
