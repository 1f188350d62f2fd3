"""Generate the Python gRPC stubs for ``proto/sluice_proto/*.proto``.

``python -m sluice_proto.generate`` regenerates in place (``make proto``);
``python -m sluice_proto.generate --check`` exits 1 when the stubs on disk are stale.
Generated files are committed and never edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PACKAGE = "sluice_proto"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc (grpcio-tools) over every .proto; returns the generated paths."""
    from grpc_tools import protoc  # dev dependency; only needed when generating

    files = proto_files()
    if not files:
        return []
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(f.relative_to(PROTO_ROOT)) for f in files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {[f.name for f in files]}")
    return sorted(p for s in SUFFIXES for p in (out_root / PACKAGE).glob(f"*{s}"))


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            current = PROTO_ROOT / PACKAGE / path.name
            if not current.exists() or not filecmp.cmp(path, current, shallow=False):
                stale.append(path.name)
        expected = {p.name for p in fresh}
        for current in (PROTO_ROOT / PACKAGE).iterdir():
            if current.name.endswith(SUFFIXES) and current.name not in expected:
                stale.append(current.name)  # left over from a deleted .proto
        return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if generated stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated stubs: {', '.join(stale)}; run `make proto`", file=sys.stderr)
            return 1
        return 0
    for path in (PROTO_ROOT / PACKAGE).iterdir():
        if path.name.endswith(SUFFIXES):
            path.unlink()
    for path in generate(PROTO_ROOT):
        print(f"generated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
