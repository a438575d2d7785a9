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
from collections.abc import Iterable

from kvbackend.store.lru_index import LruIndex

_Change = tuple[str, int | None, bool]  # (key, size or None for a drop, only if absent)


class DiskIndex:
    """key -> file size in bytes, least recently used first, and their total (an
    ``LruIndex``, whose invariants are this index's), plus the rebuild log.
    Thread-safe. Complexity: ``touch``/``refresh``/``drop`` O(1); ``pop_lru`` O(#popped);
    ``end_rebuild`` O(#found + #changes logged).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru = LruIndex()
        self._log: list[_Change] | None = None

    # ----------------------------------------------------------------- updates
    def touch(self, key: str, size: int, *, only_if_absent: bool = False) -> None:
        """Record ``key`` (``size`` bytes on disk) as most recently used; with
        ``only_if_absent`` a key already known keeps its place."""
        with self._lock:
            self._apply(key, size, only_if_absent)
            if self._log is not None:
                self._log.append((key, size, only_if_absent))

    def refresh(self, key: str) -> None:
        """Mark a known ``key`` as most recently used; an unknown one stays unknown."""
        with self._lock:
            size = self._lru.drop(key)
            if size is not None:
                self._apply(key, size, False)
                if self._log is not None:
                    self._log.append((key, size, False))

    def drop(self, key: str) -> bool:
        """Forget ``key``; True if it was known."""
        with self._lock:
            if self._log is not None:
                self._log.append((key, None, False))
            return self._apply(key, None, False)

    def pop_lru(self, max_bytes: int) -> list[str]:
        """Forget least recently used keys until at most ``max(0, max_bytes)`` bytes
        remain; returns them, oldest first (the caller deletes their files)."""
        with self._lock:
            popped = self._lru.pop_lru(max_bytes)
            if self._log is not None:
                self._log.extend((key, None, False) for key in popped)
        return popped

    def _apply(self, key: str, size: int | None, only_if_absent: bool) -> bool:
        if only_if_absent and key in self._lru:
            return True
        old = self._lru.drop(key) if size is None else self._lru.add(key, size)
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
        fresh = LruIndex(found)
        with self._lock:
            if self._log is None:
                raise RuntimeError("DiskIndex.end_rebuild without begin_rebuild")
            log, self._log = self._log, None
            self._lru = fresh
            for key, size, only_if_absent in log:
                self._apply(key, size, only_if_absent)

    # ----------------------------------------------------------------- queries
    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def __len__(self) -> int:
        return len(self._lru)

    def keys_lru(self) -> list[str]:
        """Known keys, least recently used first. O(n)."""
        with self._lock:
            return self._lru.keys()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` (naming the numbers) if an invariant fails. O(n)."""
        with self._lock:
            self._lru.check_invariants()
