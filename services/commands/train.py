"""``sluice train <stage>``: build the training data (corpus, split, vocabulary, baselines).

Only the ``data`` stage exists. Training the model (``DeepseekV4ForCausalLM`` plus MTP on
``train.bin``, scored on ``heldout.bin`` against the baselines) is a later stage and is not
registered until it works.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="build training data for a small trained model (stage: data)")
    stages = p.add_subparsers(dest="stage", metavar="STAGE")
    stages.required = True
    d = stages.add_parser(
        "data",
        help="stdlib corpus manifest, heldout-v1 split, cut tokenizer, token arrays and baseline perplexities",
    )
    d.add_argument("--out", type=Path, required=True, help="output directory")
    d.add_argument("--vocab-size", type=int, default=None, help="ids in the cut vocabulary (default 8192)")
    d.add_argument(
        "--root",
        type=Path,
        default=None,
        help="stdlib tree to read (default: this interpreter's); with --manifest, e.g. a copied 3.11 tree",
    )
    d.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="manifest.json pinning the corpus; every listed file must match, or the run stops naming them",
    )
    d.add_argument("--json", action="store_true", help="print the data.json header (without file indexes)")
    d.set_defaults(func=run_data)


def run_data(args: argparse.Namespace) -> int:
    from engine.train.data import DEFAULT_VOCAB_SIZE, build_data

    size = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    if size < 1024 or size > 1 << 17:
        raise ValueError("--vocab-size must be between 1024 and 131072")
    header = build_data(args.out, root=args.root, manifest=args.manifest, vocab_size=size)
    if args.json:
        for spec in header["arrays"].values():
            spec.pop("files", None)
        print(json.dumps(header, indent=1))
        return 0
    c, b, a = header["corpus"], header["baselines"], header["arrays"]
    tpb = header["heldout_tokens_per_byte"]
    print(
        f"corpus {c['name']} (Python {c['python_version']}): {c['n_files']} files, {c['total_bytes'] / 1e6:.2f} MB"
    )
    print(f"split {header['split']}: {a['train']['n_files']} train files, {a['heldout']['n_files']} held out")
    print(
        f"vocabulary {size} ids; held-out tokens/byte: " + ", ".join(f"{k} {v:.4f}" for k, v in tpb.items())
    )
    print(f"tokens: {a['train']['n_tokens']:,} train, {a['heldout']['n_tokens']:,} held out")
    print(
        f"held-out perplexity: unigram {b['unigram_heldout_ppl']:.2f} (add-k {b['unigram_k']}), "
        f"bigram {b['bigram_heldout_ppl']:.2f} (Kneser-Ney d {b['bigram_d']})"
    )
    print(f"wrote {args.out}")
    return 0
