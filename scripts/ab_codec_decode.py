"""A/B of ``Codec.decode`` between a git revision and the working tree, in one process.

Usage: .venv/bin/python scripts/ab_codec_decode.py REV [--size BYTES] [--seconds S]

Separate runs of ``sluice bench kvstore`` differ by more than a small change on a shared
machine. This puts both versions, and the best ISA-L peer, in the same interleaved sweeps
(``services.bench._kvstore_codec``): REV's ``kvstore`` package is exported from git into a
temporary directory as ``kvstore_rev``, its imports renamed. ``new2`` times the working
tree a second time: the run's own spread. Decode has data shards 0 and 1 missing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]


def export(rev: str, into: Path) -> None:
    """``kvstore`` at ``rev`` as the package ``kvstore_rev`` under ``into``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvstore"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    pkg = into / "kvstore"
    for path in pkg.glob("*.py"):
        text = re.sub(r"\bkvstore\.", "kvstore_rev.", path.read_text())
        text = re.sub(r"^(\s*)import kvstore$", r"\1import kvstore_rev as kvstore", text, flags=re.M)
        path.write_text(text.replace("from kvstore import", "from kvstore_rev import"))
    pkg.rename(into / "kvstore_rev")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rev", help="the git revision to compare against (e.g. HEAD~1)")
    p.add_argument("--size", type=int, default=1 << 20, help="object size in bytes")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of interleaved sweeps")
    args = p.parse_args()

    from kvstore.memtune import tune_malloc

    tune_malloc()
    with tempfile.TemporaryDirectory(prefix="sluice-ab-") as tmp:
        export(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        import kvstore_rev.codec as old  # type: ignore[import-not-found]

        import kvstore.codec as new
        from services.bench._kvstore_codec import interleaved_sweeps, pyeclib_pair

        data = os.urandom(args.size)
        fns = {}
        for name, mod in (("new", new), ("rev", old)):
            codec = mod.Codec(mod.CodecConfig())
            oid = mod.new_object_id()
            shards = [type(s)(s.header, bytes(s.payload)) for s in codec.encode(oid, data)]
            shards[0] = shards[1] = None
            if codec.decode(shards, oid) != data:
                raise SystemExit(f"{name} decoded wrong bytes")
            fns[(name, "decode2")] = lambda c=codec, s=shards, o=oid: c.decode(s, o)
        peer = pyeclib_pair("isa_l_rs_vand", 10, 2, data)  # (encode, decode of 2 missing)
        if peer is None:
            raise SystemExit("pyeclib's isa_l_rs_vand does not load here")
        fns[("peer", "decode2")] = peer[1]
        fns[("new2", "decode2")] = fns[("new", "decode2")]
        times, sweeps = interleaved_sweeps(fns, args.seconds, 2e-3)
    for (name, _), t in times.items():
        print(
            f"{name:5s} best {args.size / min(t) / 1e9:6.2f}  median {args.size / statistics.median(t) / 1e9:6.2f} GB/s"
        )
    for a, b in (("rev", "new"), ("new2", "new"), ("peer", "new"), ("peer", "rev")):
        ratios = [x / y for x, y in zip(times[(a, "decode2")], times[(b, "decode2")])]
        print(f"time {a} / {b}: median {statistics.median(ratios):.3f} over {sweeps} sweeps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
