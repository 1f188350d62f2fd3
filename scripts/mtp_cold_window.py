"""How often the trained preset's drafts are accepted, by steps since the MTP windows restarted.

A step that drafts nothing (speculation off) runs no MTP pass, so the MTP layer's sliding
window misses that step's tokens; the next step that drafts starts every sequence's window
afresh (``valid_from`` in `Speculation.draft`), and its drafts are made from a cold window.
`SpecPolicy` sets those drafts apart (docs/speculative.md, "Cold drafts"). This measures why:
one engine (the bench's `_run`, greedy, ``fixed-5``) whose executor forgets every
sequence's MTP window every ``--restart-every`` decode steps, as an off spell would, and the
acceptance at position 1, the accepted length and the head's mean confidence at position 1
by steps since the restart (0: the first drafts made after it). The restart reaches into
`Speculation`'s private record of the windows: this is a measurement, not an engine mode.

    .venv/bin/python scripts/mtp_cold_window.py --concurrency 8 --tokens 192 --restart-every 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--restart-every", type=int, default=8)
    args = ap.parse_args()

    from engine.prompts import heldout_prompts
    from engine.spec.speculation import Speculation
    from services.bench.spec import _run

    every = args.restart_every
    draft = Speculation.draft
    decode_steps = [0]  # steps that sampled (the prompts' step is the first)

    def restarting(self: Any, out: Any, *a: Any, **k: Any) -> Any:
        if any(s.sample for s in out.seqs):
            if decode_steps[0] % every == 0:
                self._mtp.clear()  # every window starts afresh at this step's run
            decode_steps[0] += 1
        return draft(self, out, *a, **k)

    Speculation.draft = restarting  # type: ignore[method-assign]
    model = Path(args.model)
    prompts = heldout_prompts(model, args.concurrency, args.prompt_tokens)
    run = _run(model, prompts, args.tokens, "fixed-5", None, {"device": "cpu", "dtype": "float32"})
    reach, hit, emitted, conf = [0] * every, [0] * every, [0] * every, [0.0] * every
    # trace step i verifies the drafts made in step i (step 0: the prompts', from windows
    # the prompts filled, left out); restarts came at steps every, 2 every, ...: the drafts
    # of step i are made (i mod every) steps after one
    for i, step in enumerate(run["_trace"]):
        if i == 0:
            continue
        since = i % every
        for c, k, accepted in step:
            if k:
                reach[since] += 1
                hit[since] += accepted > 0
                emitted[since] += 1 + accepted
                conf[since] += c[0]
    rows = [
        {
            "steps_since_restart": s,
            "requests_steps": reach[s],
            "position_1_acceptance": round(hit[s] / reach[s], 3),
            "accepted_length": round(emitted[s] / reach[s], 3),
            "head_position_1": round(conf[s] / reach[s], 3),
        }
        for s in range(every)
        if reach[s]
    ]
    print("since restart | request-steps | position-1 accepted | accepted length | head's mean (position 1)")
    for r in rows:
        print(
            f"{r['steps_since_restart']:>13} | {r['requests_steps']:>13} | {r['position_1_acceptance']:>19} | "
            f"{r['accepted_length']:>15} | {r['head_position_1']:>24}"
        )
    print(json.dumps({"config": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
