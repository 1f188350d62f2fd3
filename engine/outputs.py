"""The engine core's messages: each step's update turned into ``SeqOutput``s per request (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.messages import SeqOutput
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler, StepUpdate


@dataclass
class _Track:
    """What a request's messages have carried so far."""

    prompt_tokens: int
    sent: int = 0  # output tokens


class Outputs:
    """The requests the core reports on (added or imported; until they finish, are aborted
    or handed over) and the messages produced since the caller last took them."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._tracks: dict[str, _Track] = {}
        self._out: list[SeqOutput] = []

    @property
    def pending(self) -> bool:
        """Whether messages wait to be taken."""
        return bool(self._out)

    def track(self, request_id: str, prompt_tokens: int, sent: int = 0) -> None:
        """Report on ``request_id`` from now on; ``sent``: output tokens delivered already."""
        self._tracks[request_id] = _Track(prompt_tokens, sent=sent)

    def forget(self, request_id: str) -> None:
        """Report on ``request_id`` no more (it was handed over)."""
        self._tracks.pop(request_id, None)

    def take(self) -> list[SeqOutput]:
        out, self._out = self._out, []
        return out

    def collect(self, upd: StepUpdate) -> None:
        """A message for each tracked request that the step gave tokens or finished."""
        finished = {r.request_id: r for r in upd.finished}
        for rid in dict.fromkeys([*upd.new_tokens, *finished]):
            track = self._tracks.get(rid)
            req = finished.get(rid) or self.scheduler.requests.get(rid)
            if track is None or req is None:
                continue
            new = tuple(req.output_token_ids[track.sent :])
            lp = upd.logprobs.get(rid)
            if isinstance(lp, tuple):  # one per token of a step that accepted drafts
                lps = lp[: len(new)] + (None,) * (len(new) - len(lp))
            else:
                lps = (lp,) if len(new) == 1 else (None,) * len(new)
            reason = req.status.value if rid in finished else None
            if reason is not None:
                del self._tracks[rid]
            self._out.append(self._message(req, track, new, lps, reason))

    def end(self, req: Request, reason: str) -> None:
        """``req`` ended outside a step (aborted): its last message, if it is tracked."""
        track = self._tracks.pop(req.request_id, None)
        if track is not None:
            self._out.append(self._message(req, track, (), (), reason))

    @staticmethod
    def _message(
        req: Request, track: _Track, new: tuple[int, ...], lps: tuple[Any, ...], reason: str | None
    ) -> SeqOutput:
        track.sent += len(new)
        outs = req.output_token_ids
        stop = outs[-1] if reason == "stop" and outs and outs[-1] in req.stop_token_ids else None
        error = req.error if reason == "error" else None
        return SeqOutput(
            req.request_id, new, lps, reason, stop, error, track.prompt_tokens, max(req.num_cached_tokens, 0),
            len(outs), bounded_replay=req.bounded_replays > 0,
        )  # fmt: skip
