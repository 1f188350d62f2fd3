"""Operators a decode step and a verification step dispatch, a layer, by engine line.

On a GPU, small steps are bound by the kernels they launch; this counts the operators that
launch them (every dispatched aten operator but views), on any device, through a
`TorchDispatchMode`. One generated preset with random weights (``--preset``), one sequence
holding ``--context`` tokens, then a decode step (1 token) and a verification step
(``--query`` tokens, logits at each) as the CUDA graphs run them (``decode_graphs="padded"``).

    .venv/bin/python scripts/step_ops.py --preset small --query 2 --top 20
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
from pathlib import Path

VIEWS = {
    "view", "unsqueeze", "slice", "reshape", "_unsafe_view", "transpose", "detach", "select",
    "expand", "t", "split_with_sizes", "unbind", "as_strided", "permute", "squeeze", "alias",
    "split", "_reshape_alias", "lift_fresh",
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--query", type=int, default=2, help="tokens of the verification step")
    ap.add_argument("--top", type=int, default=15, help="engine lines listed a step")
    args = ap.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.checkpoint.generate import generate_checkpoint
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.runner import ModelRunner, RunnerConfig

    model = Path(tempfile.mkdtemp()) / "model"
    generate_checkpoint(args.preset, model, seed=0)
    runner = ModelRunner(model, RunnerConfig(num_blocks=8, num_slots=2, decode_graphs="padded"))
    layers = runner.model_cfg.num_hidden_layers
    tokens = torch.randint(3, 200, (args.context + args.query,), generator=torch.Generator().manual_seed(0))
    ids, n0 = tokens.tolist(), args.context
    runner.execute(ForwardBatch.from_sequences([SequenceInput(ids[:n0], 0, 0, [0, 1])]))

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.lines: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEWS:
                frames = [f for f in traceback.extract_stack() if "/engine/" in f.filename]
                where = f"{frames[-1].filename.split('/engine/')[1]}:{frames[-1].lineno}" if frames else "?"
                self.lines[f"{where} {name}"] += 1
            return func(*args, **(kwargs or {}))

    for q in (1, args.query):
        seq = SequenceInput(ids[n0 : n0 + q], n0, 0, [0, 1], num_logits=q)
        runner.execute(ForwardBatch.from_sequences([seq]))  # first run: nothing counted
        with Count() as count:
            runner.execute(ForwardBatch.from_sequences([seq]))
        total = sum(count.lines.values())
        print(
            f"{'decode' if q == 1 else f'verification ({q} tokens)'}: {total} ops, {total / layers:.1f} a layer"
        )
        for line, n in count.lines.most_common(args.top):
            print(f"  {n / layers:6.1f}  {line}")


if __name__ == "__main__":
    main()
