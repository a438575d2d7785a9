"""The disk tier's in-memory index and its rescans, at up to a million block files.

    python benchmarks/bench_disk_index.py [--files 10000,100000,1000000] [--dir DIR]

For each count, empty block files (valid names, no contents: the index and the
walk only look at names, sizes and mtimes) are created under a fresh identity
directory in DIR (default: the system temp directory), then:

* rescan: a read-only ``DiskTier`` opening the directory, i.e. one no-follow walk
  plus the index build (the dentries are warm from the creation);
* index memory per entry: bytes the tier keeps after that rescan (its
  ``DiskIndex``), and the rescan's transient peak (tracemalloc);
* probe: one ``contains`` of a probe-only tier (what a scheduler asks), which
  keeps no index at all.

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import tempfile
import time
import tracemalloc

from kvbackend.store import CacheIdentity, DiskTier
from kvbackend.store.layout import block_path

IDENTITY = CacheIdentity("ab" * 32, "bfloat16", 16, "bench")
PROBES = 20000


def key(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest()


def create_files(root: str, count: int) -> str:
    """``count`` empty block files of IDENTITY under ``root``; returns the identity dir."""
    base = DiskTier(root, 1 << 40, IDENTITY, rescan_interval_s=None).base
    for sub in range(256):
        os.makedirs(os.path.join(base, f"{sub:02x}"), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for i in range(count):
        os.close(os.open(block_path(base, key(i)), flags, 0o600))
    return base


def measure(root: str, count: int) -> dict:
    start = time.perf_counter()
    create_files(root, count)
    created_s = time.perf_counter() - start

    gc.collect()
    start = time.perf_counter()
    tier = DiskTier(root, 1 << 40, IDENTITY, read_only=True, rescan_interval_s=None)
    rescan_s = time.perf_counter() - start
    assert len(tier) == count, (len(tier), count)
    del tier
    gc.collect()

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tier = DiskTier(root, 1 << 40, IDENTITY, read_only=True, rescan_interval_s=None)
    gc.collect()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del tier

    probe = DiskTier(root, 1 << 40, IDENTITY, probe_only=True)
    keys = [key(i * 7919 % count) for i in range(PROBES)]
    start = time.perf_counter()
    assert all(probe.contains(k) for k in keys)
    probe_us = (time.perf_counter() - start) / PROBES * 1e6
    assert len(probe) == 0
    return dict(files=count, created_s=created_s, rescan_s=rescan_s,
                per_entry=(kept - before) / count, peak=(peak - before) / count,
                probe_us=probe_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="10000,100000,1000000",
                        help="comma-separated file counts")
    parser.add_argument("--dir", default=None, help="where to create the files")
    args = parser.parse_args()
    rows = []
    for count in (int(c) for c in args.files.split(",")):
        root = tempfile.mkdtemp(prefix="kvb-index-", dir=args.dir)
        try:
            rows.append(measure(os.path.join(root, "cache"), count))
        finally:
            shutil.rmtree(root)
        print(f"done: {count} files", flush=True)
    print("\n| files | rescan (s) | rescan per file (us) | index bytes/entry "
          "| rescan peak bytes/entry | probe-only contains (us) | (creating them, s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['files']:,} | {r['rescan_s']:.2f} | {r['rescan_s'] / r['files'] * 1e6:.2f} "
              f"| {r['per_entry']:.0f} | {r['peak']:.0f} | {r['probe_us']:.2f} "
              f"| {r['created_s']:.1f} |")


if __name__ == "__main__":
    main()
