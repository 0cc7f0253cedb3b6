"""Measure what the runtime's integrity check costs at startup: full sha256 vs the proof record.

    python samples/startup_cost.py OUT_DIR [--repeats 3] [--json startup.json]

For an export directory, times (median of ``--repeats``) ``Manifest.read`` with ``verify="full"``
(hash every file), ``verify=True`` once a proof record exists (stat every file, hash nothing) and
``verify=False`` (schema and confinement only), and ``graphs.load`` end to end with the first two.
Writes JSON; the hash throughput gives the full check's cost at any size (TinyLlama-1.1B: 4.4 GB).
Proof records go to a temporary cache directory, removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINYLLAMA_BYTES = 4.4e9


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(out_dir: Path, repeats: int) -> dict:
    import graphs
    import graphs.integrity as integrity
    from graphs.manifest import Manifest

    files = Manifest.read(out_dir, verify=False).files
    size = sum((out_dir / f).stat().st_size for f in files)
    integrity.forget(out_dir)
    full = _median_time(lambda: Manifest.read(out_dir, verify="full"), repeats)
    young = integrity.RACY_NS
    integrity.RACY_NS = 0  # a just-written export: trust it here so that the record gets written
    Manifest.read(out_dir, verify="full")
    integrity.RACY_NS = young
    cached = _median_time(lambda: Manifest.read(out_dir, verify=True), repeats)
    none = _median_time(lambda: Manifest.read(out_dir, verify=False), repeats)
    load_full = _median_time(lambda: graphs.load(out_dir, provider="cpu", verify="full"), repeats)
    load_cached = _median_time(lambda: graphs.load(out_dir, provider="cpu", verify=True), repeats)
    throughput = size / full
    return {
        "out_dir": str(out_dir),
        "files": len(files),
        "bytes": size,
        "repeats": repeats,
        "verify_full_s": full,
        "verify_cached_s": cached,
        "verify_none_s": none,
        "load_full_s": load_full,
        "load_cached_s": load_cached,
        "hash_throughput_mb_s": throughput / 1e6,
        "full_check_at_4_4_gb_s": TINYLLAMA_BYTES / throughput,
        "speedup_of_check": full / cached if cached > 0 else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specexport-cache-") as cache:
        os.environ["SPECEXPORT_CACHE_DIR"] = cache
        result = measure(args.out_dir, max(1, args.repeats))
    for k, v in result.items():
        print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
