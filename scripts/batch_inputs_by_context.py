"""Host time of one decode step's `ForwardBatch.from_sequences` by context length: ``--batch``
decoding sequences (one new token each) whose block tables hold ``blocks`` entries each
(256 tokens a block), mean ms of ``--calls`` builds. The batch carries every sequence's whole
block table each step, so this part of the host's step grows with the context, not only with
the batch.

    PYTHONPATH=$PWD:$PWD/proto .venv/bin/python scripts/batch_inputs_by_context.py
"""

from __future__ import annotations

import argparse
import timeit

from engine.forward_batch import ForwardBatch, SequenceInput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--blocks", default="1,32,128,512", help="block-table entries a sequence, a comma list")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    print(f"{'blocks':>7} {'context':>8} {'ms a build':>11}")
    for blocks in (int(x) for x in args.blocks.split(",")):
        seqs = [
            SequenceInput(
                token_ids=(5,),
                num_computed=blocks * 256 - 10,
                swa_slot=i,
                block_table=tuple(range(i * blocks, (i + 1) * blocks)),
            )  # fmt: skip
            for i in range(args.batch)
        ]
        seconds = timeit.timeit(lambda s=seqs: ForwardBatch.from_sequences(s), number=args.calls) / args.calls
        print(f"{blocks:>7} {blocks * 256:>8} {seconds * 1e3:>11.3f}")


if __name__ == "__main__":
    main()
