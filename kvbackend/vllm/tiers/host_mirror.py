"""The scheduler's copy of what every worker's host tier holds.

The scheduler alone decides what the workers keep in host memory: each
eviction it makes here reaches the workers as a drop order, applied before any
put of the same step, and ``capacity`` blocks fit in each worker's host tier, so
a worker never evicts on its own and every worker holds exactly these keys once
the step's orders have run. Until then the keys inserted in the step are
*arriving*: a load in the step promotes them, or a save puts them, and no host
tier holds them yet (a read that fails never puts them). Only keys the workers
``holds`` are host hits.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import NamedTuple


class Insertion(NamedTuple):
    """What ``HostMirror.insert`` did: whether ``key`` is new, and the keys it evicted."""

    added: bool
    evicted: tuple[str, ...]


class HostMirror:
    """Block keys in least-recently-used order, at most ``capacity`` of them.

    A pinned key (a lookup or a load in flight lists it) is never evicted; pins are
    counted, so several requests may pin one key. A key ``insert`` added stays
    arriving until ``orders_sent``.

    Invariants (``check_invariants``):
      * ``len(self) <= capacity``
      * every pin count is positive
      * every arriving key is a key, and none is pinned (only held keys are host hits)
    Complexity: O(1) per lookup, touch, remove and pin; ``insert`` O(1 + pinned keys
    it skips while looking for a victim); ``orders_sent`` O(arriving keys).
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._pins: Counter[str] = Counter()
        self._arriving: set[str] = set()  # inserted since the last orders_sent

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def holds(self, key: str) -> bool:
        """Whether every worker's host tier holds ``key`` now, not only once this
        step's orders have run. O(1)."""
        return key in self._lru and key not in self._arriving

    def orders_sent(self) -> None:
        """The step's orders went out: once they have run, the workers hold its
        arriving keys (a failed load's key is ``remove``d then). O(arriving keys)."""
        self._arriving.clear()

    def keys(self) -> list[str]:
        """The keys, least recently used first. O(n)."""
        return list(self._lru)

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used, if present. O(1)."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def insert(self, key: str) -> Insertion:
        """Add ``key`` as most recently used (or touch it if present), evicting the
        least recently used unpinned key when full. Refused (added False, nothing
        evicted) when the capacity is 0 or every key is pinned. An added key is
        arriving."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return Insertion(False, ())
        evicted: tuple[str, ...] = ()
        if len(self._lru) >= self.capacity:
            victim = next((k for k in self._lru if k not in self._pins), None)
            if victim is None:
                return Insertion(False, ())
            del self._lru[victim]
            self._arriving.discard(victim)
            evicted = (victim,)
        self._lru[key] = None
        self._arriving.add(key)
        return Insertion(True, evicted)

    def remove(self, key: str) -> bool:
        """Forget ``key`` (pinned or not); True if it was present. O(1)."""
        if key not in self._lru:
            return False
        del self._lru[key]
        self._arriving.discard(key)
        return True

    def clear(self) -> None:
        """Forget every key and every pin. O(n)."""
        self._lru.clear()
        self._pins.clear()
        self._arriving.clear()

    def pin(self, key: str) -> None:
        self._pins[key] += 1

    def unpin(self, key: str) -> None:
        """Undo one ``pin(key)``; raises ``RuntimeError`` if there is none (a bug)."""
        count = self._pins.get(key, 0)
        if count <= 0:
            raise RuntimeError(f"unpinning {key[:16]}, which is not pinned; this indicates a bug")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    def pin_count(self, key: str) -> int:
        return self._pins.get(key, 0)

    def num_pinned(self) -> int:
        """Distinct pinned keys. O(1)."""
        return len(self._pins)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant. O(n)."""
        assert len(self._lru) <= self.capacity, (
            f"{len(self._lru)} keys exceed the capacity of {self.capacity}")
        bad = [key for key, count in self._pins.items() if count <= 0]
        assert not bad, f"non-positive pin counts for {bad[:3]}"
        unknown = [key for key in self._arriving if key not in self._lru]
        assert not unknown, f"arriving keys {unknown[:3]} are not in the mirror"
        early = [key for key in self._arriving if key in self._pins]
        assert not early, f"keys {early[:3]} are pinned as host hits before any host holds them"


__all__ = ["HostMirror", "Insertion"]
