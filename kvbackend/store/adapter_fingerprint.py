"""What a LoRA adapter *is*: a fingerprint of its files' contents, not of its name.

Serving engines name adapters by a user-chosen name that can be re-pointed to other
weights (unload + load, in-place reload); KV computed under one adapter must never
be reused under another. ``adapter_fingerprint`` hashes what decides the adapter's
effect: its weight files (via :func:`model_fingerprint`, memoized by path, size and
mtime) and ``adapter_config.json`` (rank, alpha, target modules). ``adapter_stamp``
is a cheap stamp (one ``stat`` per top-level file) that changes whenever any of
those files is replaced or rewritten, so callers can memoize fingerprints in memory.
Same caveat as ``model_fingerprint``: a file rewritten in place with the same size
and mtime_ns keeps its stamp.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvbackend.store.identity import model_fingerprint

ADAPTER_CONFIG = "adapter_config.json"

Stamp = tuple[tuple[str, int, int, int], ...]


def adapter_fingerprint(adapter_dir: str | os.PathLike, *,
                        memo_path: str | os.PathLike | None = None) -> str:
    """sha256 over the adapter's weight files and ``adapter_config.json``.

    Raises ``ValueError`` without a weight file, ``OSError`` when a file cannot be
    read. O(total bytes) the first time, O(#files) stats once memoized.
    """
    adapter_dir = Path(adapter_dir)
    outer = hashlib.sha256(b"kvbackend-adapter-fingerprint-v1\n")
    outer.update(model_fingerprint(adapter_dir, memo_path=memo_path).encode())
    config = adapter_dir / ADAPTER_CONFIG
    if config.is_file():
        outer.update(b"\0" + hashlib.sha256(config.read_bytes()).hexdigest().encode())
    return outer.hexdigest()


def adapter_stamp(adapter_dir: str | os.PathLike) -> Stamp:
    """(name, size, mtime_ns, inode) of every top-level regular file, sorted by name.
    Raises ``OSError`` if the directory cannot be listed. O(#files) stats."""
    stamp = []
    with os.scandir(adapter_dir) as entries:
        for entry in entries:
            if entry.is_file():  # follows symlinks (Hugging Face cache layout)
                st = entry.stat()
                stamp.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(stamp))


__all__ = ["ADAPTER_CONFIG", "Stamp", "adapter_fingerprint", "adapter_stamp"]
