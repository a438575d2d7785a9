"""In-memory LRU tier: key -> payload, bounded by payload bytes.

Invariants (``check_invariants``):
    * the LRU index (``LruIndex``) knows exactly the stored keys, and its total
      ``bytes_used == sum(entry.nbytes) <= max_bytes``
    * every entry's ``nbytes == payload_nbytes(entry.payload)``
    * LRU order: the index runs from least to most recently used; each entry's
      access stamp is strictly greater than its predecessor's and not after the
      tier's clock.

Payloads are stored by reference when they are ``bytes`` or ``np.ndarray``
(zero copy: the caller hands the array over and must not mutate it);
``bytearray`` and ``memoryview`` are copied to ``bytes`` since they are views
on buffers the caller keeps writing. Thread-safe (one lock; all operations O(1)
except eviction, O(#evicted)).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbackend.store.lru_index import LruIndex
from kvbackend.store.tier import Payload, check_key, payload_nbytes


@dataclass(slots=True)
class _Entry:
    payload: bytes | np.ndarray
    nbytes: int
    num_tokens: int
    stamp: int


class HostTier:
    """LRU cache of KV block payloads in host memory, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        self._lru = LruIndex()  # the entries' keys and sizes, least recently used first
        self._clock = 0
        self._lock = threading.Lock()
        self._counters = dict(hits=0, misses=0, puts=0, rejected=0, evictions=0)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._lru.bytes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _evict_locked(self, max_bytes: int) -> int:
        victims = self._lru.pop_lru(max_bytes)
        for key in victims:
            del self._entries[key]
        self._counters["evictions"] += len(victims)
        return len(victims)

    def put(self, key: str, payload: Payload, num_tokens: int) -> bool:
        """Insert or replace ``key`` as most recently used; evicts LRU entries to fit.

        Returns False (and stores nothing) if the payload alone exceeds ``max_bytes``.
        """
        check_key(key)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        nbytes = payload_nbytes(payload)
        if isinstance(payload, (bytearray, memoryview)):
            payload = bytes(payload)
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._lru.drop(key)
            if nbytes > self.max_bytes:
                self._counters["rejected"] += 1
                return False
            self._evict_locked(self.max_bytes - nbytes)
            self._entries[key] = _Entry(payload, nbytes, num_tokens, self._tick())
            self._lru.add(key, nbytes)
            self._counters["puts"] += 1
            return True

    def get(self, key: str) -> bytes | np.ndarray | None:
        """The payload, marked most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
            self._lru.touch(key)
            entry.stamp = self._tick()
            self._counters["hits"] += 1
            return entry.payload

    def num_tokens(self, key: str) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.num_tokens

    def contains(self, key: str) -> bool:
        return key in self._entries

    def contains_prefix(self, keys: list[str]) -> int:
        """O(result + 1)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def remove(self, key: str) -> bool:
        with self._lock:
            if self._entries.pop(key, None) is None:
                return False
            self._lru.drop(key)
            return True

    def evict_to(self, max_bytes: int) -> int:
        with self._lock:
            return self._evict_locked(max(0, max_bytes))

    def keys_lru(self) -> list[str]:
        """Keys from least to most recently used. O(n)."""
        with self._lock:
            return self._lru.keys()

    def stats(self) -> dict[str, Any]:
        return dict(self._counters, entries=len(self._entries), bytes=self._lru.bytes,
                    max_bytes=self.max_bytes)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant (plain raises, so
        ``python -O`` keeps them). O(n)."""
        if len(self._lru) != len(self._entries):
            raise RuntimeError(f"LRU index holds {len(self._lru)} keys, the tier "
                               f"{len(self._entries)}")
        total = 0
        prev_stamp = 0
        for key in self._lru.keys():
            entry = self._entries.get(key)
            if entry is None:
                raise RuntimeError(f"{key}: in the LRU index, not in the tier")
            actual = payload_nbytes(entry.payload)
            if entry.nbytes != actual:
                raise RuntimeError(f"{key}: nbytes {entry.nbytes} != payload {actual}")
            if entry.stamp <= prev_stamp:
                raise RuntimeError(
                    f"{key}: LRU stamp {entry.stamp} not after predecessor's {prev_stamp}")
            prev_stamp = entry.stamp
            total += entry.nbytes
        if prev_stamp > self._clock:
            raise RuntimeError(f"stamp {prev_stamp} ahead of clock {self._clock}")
        if total != self._lru.bytes:
            raise RuntimeError(f"bytes accounted {self._lru.bytes} != sum of payloads {total}")
        if total > self.max_bytes:
            raise RuntimeError(f"bytes {total} exceed max_bytes {self.max_bytes}")
        self._lru.check_invariants()
