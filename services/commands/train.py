"""``sluice train <stage>``: the trained preset, from data to checkpoint (``docs/training.md``).

* ``data``: corpus manifest, held-out split, cut vocabulary, token arrays, baselines;
* ``model``: train ``DeepseekV4ForCausalLM`` plus its MTP layer on a data directory, and
  score it on the held-out split (perplexity beside the baselines, MTP acceptance);
* ``unlikelihood``: continue a ``model`` checkpoint for a few steps with token-level
  unlikelihood added, against greedy repetition loops; score it as ``model`` does;
* ``drafter``: distil a checkpoint's MTP layer from its frozen target over chained passes
  (the drafts speculation verifies); the target's tensors are written back unchanged;
* ``headers``: greedy continuations of 20 held-out function headers through the engine;
* ``confidence``: fit the MTP drafts' confidence head on the model's own drafts over the
  training split, and report its calibration on the held-out split.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train the small trained preset (stages: data, model, unlikelihood, drafter, eval, headers, confidence)",
    )
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

    from engine.train.settings import TrainSettings

    m = stages.add_parser(
        "model", help="train the model plus its MTP layer on a data directory; write a checkpoint"
    )
    m.add_argument("--data", type=Path, required=True, help="a `sluice train data` output directory")
    m.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    m.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    m.add_argument("--json", action="store_true", help="print training.json")
    m.add_argument(
        "--stop-after", type=int, default=None, help="end this call after that many steps, saving the state"
    )
    m.add_argument("--resume", action="store_true", help="continue from the state a --stop-after call saved")
    m.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="replace one preset config value (e.g. moe_intermediate_size=64, layer_types='[...]'); "
        "repeatable; recorded in training.json as model_overrides",
    )
    _settings_args(m, TrainSettings)
    m.set_defaults(func=run_model)

    from engine.train.settings import UnlikelihoodSettings

    u = stages.add_parser(
        "unlikelihood",
        help="continue a `model` checkpoint with token-level unlikelihood (against greedy loops); write a checkpoint",
    )
    _checkpoint_args(u)
    u.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (not --model)")
    u.add_argument("--json", action="store_true", help="print training.json")
    _settings_args(u, UnlikelihoodSettings)
    u.set_defaults(func=run_unlikelihood)

    from engine.train.settings import DrafterSettings

    r = stages.add_parser(
        "drafter",
        help="distil a checkpoint's MTP layer from its frozen target, chained passes; write a checkpoint",
    )
    _checkpoint_args(r)
    r.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (not --model)")
    r.add_argument("--json", action="store_true", help="print training.json")
    _settings_args(r, DrafterSettings)
    r.set_defaults(func=run_drafter)

    e = stages.add_parser(
        "eval", help="score a checkpoint on heldout-v1: perplexity beside the baselines, MTP acceptance"
    )
    _checkpoint_args(e)
    e.add_argument(
        "--seq-len", type=int, default=4096, help="scoring window (default 4096, the training context)"
    )
    e.add_argument("--accept-prompts", type=int, default=64)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=run_eval)

    h = stages.add_parser(
        "headers", help="greedy continuations of held-out function headers, parsed with ast"
    )
    _checkpoint_args(h)
    h.add_argument("--n", type=int, default=20)
    h.add_argument("--max-tokens", type=int, default=96)
    h.add_argument(
        "--context-tokens", type=int, default=0,
        help="continue each header in its file: the prompt carries up to this many tokens of the file "
        "before it (default 0: the header alone)",
    )  # fmt: skip
    h.add_argument("--markdown", type=Path, default=None, help="also write the markdown report here")
    h.add_argument("--json", action="store_true", help="print the JSON report")
    h.set_defaults(func=run_headers)

    from engine.train.settings import ConfidenceSettings

    c = stages.add_parser(
        "confidence",
        help="fit the MTP drafts' confidence head on the model's own drafts; calibration on heldout-v1",
    )
    _checkpoint_args(c)
    c.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory to write confidence/model.safetensors and confidence/confidence.json into "
        "(e.g. the checkpoint directory; nothing else there is touched)",
    )
    c.add_argument("--json", action="store_true", help="print confidence.json")
    _settings_args(c, ConfidenceSettings)
    c.set_defaults(func=run_confidence)


def _settings_args(p: argparse.ArgumentParser, settings: type) -> None:
    """One ``--flag`` per field of a settings dataclass, its default the field's."""
    for f in dataclasses.fields(settings):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            help=f"(default {f.default})",
        )


def _settings_from(args: argparse.Namespace, settings: type) -> Any:
    return settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings)})


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    """--model, --data, --device: what scores a written checkpoint."""
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument(
        "--data", type=Path, required=True, help="the `sluice train data` directory it was trained on"
    )
    p.add_argument("--device", default="cpu")


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


def run_model(args: argparse.Namespace) -> int:
    from engine.train.trainer import TrainSettings, train

    settings = _settings_from(args, TrainSettings)
    info = train(
        args.data,
        args.out,
        settings,
        device=args.device,
        model_overrides=parse_overrides(args.override) or None,
        stop_after=args.stop_after,
        resume=args.resume,
    )
    if info is None:
        print(f"stopped after step {args.stop_after}; continue with the same command and --resume")
        return 0
    return _print_trained(info, args)


def run_unlikelihood(args: argparse.Namespace) -> int:
    from engine.train.unlikelihood import UnlikelihoodSettings, train_unlikelihood

    settings = _settings_from(args, UnlikelihoodSettings)
    info = train_unlikelihood(args.model, args.data, args.out, settings, device=args.device)
    return _print_trained(info, args)


def run_drafter(args: argparse.Namespace) -> int:
    from engine.train.drafter import DrafterSettings, train_drafter

    settings = _settings_from(args, DrafterSettings)
    info = train_drafter(args.model, args.data, args.out, settings, device=args.device)
    return _print_trained(info, args)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``KEY=JSON`` strings -> a dict; a value that is not JSON is taken as a plain string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--override wants KEY=JSON, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def run_eval(args: argparse.Namespace) -> int:
    from engine.train.trainer import evaluate_checkpoint

    report = evaluate_checkpoint(
        args.model, args.data, device=args.device, seq_len=args.seq_len, accept_prompts=args.accept_prompts
    )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print_measures(report)
    return 0


def _print_trained(info: dict, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    _print_measures(info)
    print(f"trained in {info['train_seconds']:.0f} s on {info['environment']['device']}; wrote {args.out}")
    return 0


def _print_measures(report: dict) -> None:
    held, acc = report["heldout"], report["mtp_acceptance"]
    print(
        f"heldout-v1 perplexity {held['ppl']:.2f} (bigram {held['bigram_ppl']:.2f}, "
        f"ratio {held['ratio_to_bigram']:.3f}; unigram {held['unigram_ppl']:.1f})"
    )
    print("MTP acceptance at positions 1-5: " + ", ".join(f"{a:.3f}" for a in acc["conditional"]))


def run_headers(args: argparse.Namespace) -> int:
    from engine.train.headers import continuations, render_markdown, run_headers

    report = run_headers(
        args.model, args.data, n=args.n, max_tokens=args.max_tokens, device=args.device,
        context_tokens=args.context_tokens,
    )  # fmt: skip
    if args.markdown is not None:
        args.markdown.write_text(render_markdown(continuations(report)))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['parsed']} of {report['n']} held-out header continuations parse with ast")
    return 0


def run_confidence(args: argparse.Namespace) -> int:
    from engine.train.confidence import ConfidenceSettings, train_confidence

    settings = _settings_from(args, ConfidenceSettings)
    report = train_confidence(args.model, args.data, args.out, settings, device=args.device)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    held = report["heldout"]
    auc = "n/a" if held["auc"] is None else f"{held['auc']:.3f}"
    print(
        f"heldout-v1: {held['n']} drafts, Brier {held['brier']:.4f} (constant rate {held['brier_constant_train_rate']:.4f}, "
        f"per-position rates {held['brier_constant_per_position']:.4f}), AUC {auc}, ECE {held['ece']:.4f}"
    )
    print(
        "mean confidence / observed acceptance at positions 1-5: "
        + ", ".join(
            f"{p['mean_confidence']:.3f}/{p['observed']:.3f}" if p["n"] else "-/-" for p in held["positions"]
        )
    )
    print(f"fitted in {report['timings']['total_s']:.0f} s; wrote {args.out / 'confidence'}")
    return 0
