"""What one process knows of an identity directory's block files: an LRU index by bytes.

The directory is the truth (other processes write and evict in it); the index
orders what this process has seen, for eviction. It is rebuilt from a scan of
the directory, which runs without the index's lock (1M files take seconds), so
a rebuild is bracketed: ``begin_rebuild`` starts a log of every change, and
``end_rebuild(found)`` installs the scan's result with the logged changes
replayed on top, so a put, hit or eviction made meanwhile is never lost.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

_Change = tuple[str, int | None, bool]  # (key, size or None for a drop, only if absent)


class DiskIndex:
    """key -> file size in bytes, least recently used first, and their total.

    Invariant (``check_invariants``): ``bytes`` is the sum of the sizes, each >= 0.
    Thread-safe. Complexity: ``touch``/``drop`` O(1); ``pop_lru`` O(#popped);
    ``end_rebuild`` O(#found + #changes logged).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._log: list[_Change] | None = None

    # ----------------------------------------------------------------- updates
    def touch(self, key: str, size: int, *, only_if_absent: bool = False) -> None:
        """Record ``key`` (``size`` bytes on disk) as most recently used; with
        ``only_if_absent`` a key already known keeps its place."""
        with self._lock:
            self._apply(key, size, only_if_absent)
            if self._log is not None:
                self._log.append((key, size, only_if_absent))

    def drop(self, key: str) -> bool:
        """Forget ``key``; True if it was known."""
        with self._lock:
            if self._log is not None:
                self._log.append((key, None, False))
            return self._apply(key, None, False)

    def pop_lru(self, max_bytes: int) -> list[str]:
        """Forget least recently used keys until at most ``max(0, max_bytes)`` bytes
        remain; returns them, oldest first (the caller deletes their files)."""
        popped = []
        with self._lock:
            while self._bytes > max(0, max_bytes) and self._sizes:
                key, size = self._sizes.popitem(last=False)
                self._bytes -= size
                popped.append(key)
                if self._log is not None:
                    self._log.append((key, None, False))
        return popped

    def _apply(self, key: str, size: int | None, only_if_absent: bool) -> bool:
        if only_if_absent and key in self._sizes:
            return True
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old
        if size is not None:
            self._sizes[key] = size
            self._bytes += size
        return old is not None

    # ----------------------------------------------------------------- rebuild
    def begin_rebuild(self) -> None:
        """Start logging changes for an ``end_rebuild`` (one rebuild at a time)."""
        with self._lock:
            if self._log is not None:
                raise RuntimeError("DiskIndex.begin_rebuild: a rebuild is already open")
            self._log = []

    def end_rebuild(self, found: Iterable[tuple[str, int]]) -> None:
        """Replace the contents by ``found`` ((key, size) pairs, least recently used
        first, from a scan made since ``begin_rebuild``), then replay the changes
        logged meanwhile, and stop logging."""
        fresh = OrderedDict(found)
        with self._lock:
            if self._log is None:
                raise RuntimeError("DiskIndex.end_rebuild without begin_rebuild")
            log, self._log = self._log, None
            self._sizes, self._bytes = fresh, sum(fresh.values())
            for key, size, only_if_absent in log:
                self._apply(key, size, only_if_absent)

    # ----------------------------------------------------------------- queries
    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys_lru(self) -> list[str]:
        """Known keys, least recently used first. O(n)."""
        with self._lock:
            return list(self._sizes)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` (naming the numbers) if an invariant fails. O(n)."""
        with self._lock:
            total = sum(self._sizes.values())
            if total != self._bytes:
                raise RuntimeError(f"DiskIndex: bytes is {self._bytes}, sizes sum to {total}")
            negative = [k for k, s in self._sizes.items() if s < 0]
            if negative:
                raise RuntimeError(f"DiskIndex: negative sizes for {negative[:3]}")
