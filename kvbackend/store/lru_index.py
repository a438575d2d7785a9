"""Keys in least-recently-used order, each with a size in bytes, and their total:
the one LRU index of the host tier (payloads in memory) and the disk tier (files).

Invariants (``check_invariants``): ``bytes`` is the sum of the sizes; every size >= 0.
Not thread-safe: its owner holds its own lock around every call.
Complexity: ``add`` / ``touch`` / ``drop`` / ``in`` O(1); ``pop_lru`` O(#popped);
``keys`` O(n).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LruIndex:
    """key -> size, least recently used first; ``items`` seeds it in that order."""

    def __init__(self, items: Iterable[tuple[str, int]] = ()) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict(items)
        self._bytes = sum(self._sizes.values())

    def add(self, key: str, size: int) -> int | None:
        """Record ``key`` (``size`` bytes) as most recently used; returns its old size,
        or None if it was not known."""
        old = self.drop(key)
        self._sizes[key] = size
        self._bytes += size
        return old

    def touch(self, key: str) -> bool:
        """Mark a known ``key`` as most recently used; False if it is not known."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def drop(self, key: str) -> int | None:
        """Forget ``key``; returns its size, or None if it was not known."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._bytes -= size
        return size

    def pop_lru(self, max_bytes: int) -> list[str]:
        """Forget least recently used keys until at most ``max(0, max_bytes)`` bytes
        remain; returns them, oldest first."""
        popped = []
        while self._bytes > max(0, max_bytes) and self._sizes:
            key, size = self._sizes.popitem(last=False)
            self._bytes -= size
            popped.append(key)
        return popped

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def keys(self) -> list[str]:
        """The keys, least recently used first. O(n)."""
        return list(self._sizes)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` (naming the numbers) if an invariant fails. O(n)."""
        total = sum(self._sizes.values())
        if total != self._bytes:
            raise RuntimeError(f"LRU index: bytes is {self._bytes}, sizes sum to {total}")
        negative = [k for k, s in self._sizes.items() if s < 0]
        if negative:
            raise RuntimeError(f"LRU index: negative sizes for {negative[:3]}")
