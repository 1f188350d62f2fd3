"""A checkpoint with another run's MTP layer: ``BASE`` copied to ``OUT``, its ``mtp.*`` tensors
replaced by those in ``MTP`` (a safetensors file with exactly the base's ``mtp.*`` names and
shapes; ValueError otherwise). Every other tensor, the file's metadata and the directory's
other files (``confidence/`` included) are the base's.

The device tool brings back files up to 16 MiB, less than the trained preset's
``model.safetensors``; a drafter-stage run on the device saves its ``mtp.*`` tensors alone,
and this puts them back into the checkpoint it started from. ``training.json`` and
``curve_drafter.jsonl`` beside ``MTP`` replace the base's when present.

    .venv/bin/python scripts/mtp_into_checkpoint.py --mtp run/mtp.safetensors --out var/joint
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=Path("models/trained"))
    p.add_argument("--mtp", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.out.resolve() == args.base.resolve():
        raise ValueError("--out must differ from --base")
    with safe_open(str(args.base / "model.safetensors"), "pt") as f:  # one read: tensors and metadata
        metadata = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open handles are not mappings
    mtp = load_file(str(args.mtp))
    want = {k: v.shape for k, v in state.items() if k.startswith("mtp.")}
    got = {k: v.shape for k, v in mtp.items()}
    if got != want:
        raise ValueError(f"{args.mtp}: its tensors differ from the base's mtp.* in names or shapes")
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.base, args.out)
    state.update(mtp)
    save_file(state, str(args.out / "model.safetensors"), metadata=metadata)
    for name in ("training.json", "curve_drafter.jsonl"):
        if (args.mtp.parent / name).is_file():
            shutil.copyfile(args.mtp.parent / name, args.out / name)
    (args.out / "sluice_fingerprint.json").unlink(missing_ok=True)  # the engine's cache of the old file
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
