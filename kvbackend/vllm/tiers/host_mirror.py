"""The scheduler's copy of what every worker's host tier holds.

The scheduler alone decides what the workers keep in host memory: each
eviction it makes here reaches the workers as a drop order, applied before any
put of the same step, and ``capacity`` blocks fit in each worker's host tier, so
a worker never evicts on its own and every worker holds exactly these keys once
the step's orders have run. Until then the keys inserted in the step are
*arriving*: a load in the step promotes them, or a save puts them, and no host
tier holds them yet (a read that fails never puts them). Only keys the workers
``holds`` are host hits.

Retention (``kv_retain_s``) reaches the host tier here: a retained key is evicted
only once no unpinned ordinary key is left, until its time is up; then, or when
more than ``max_retained`` keys are retained (the oldest-used goes first), it
becomes the least recently used ordinary key: a conversation that did not come
back in time is the first to leave.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from itertools import chain
from typing import NamedTuple


class Insertion(NamedTuple):
    """What ``HostMirror.insert`` did: whether ``key`` is new, and the keys it evicted."""

    added: bool
    evicted: tuple[str, ...]


class HostMirror:
    """Block keys in eviction order, at most ``capacity`` of them: ordinary keys least
    recently used first, then retained keys least recently used first.

    A pinned key (a lookup or a load in flight lists it) is never evicted; pins are
    counted, so several requests may pin one key. A key ``insert`` added stays
    arriving until ``orders_sent``. ``retain(keys, until)`` keeps keys behind every
    ordinary key until ``expire(now)`` sees ``until`` pass (see the module docstring).

    Invariants (``check_invariants``):
      * ``len(self) <= capacity``; a key is ordinary or retained, never both
      * at most ``max_retained`` keys are retained, each with an expiry heap entry
        ``(until, key)`` (the heap may also hold stale entries)
      * every pin count is positive
      * every arriving key is a key, and none is pinned (only held keys are host hits)
    Complexity: O(1) per lookup, touch, remove and pin; ``insert`` O(1 + pinned (and,
    ``ordinary_only``, arriving) keys it skips while looking for a victim); ``retain``
    O(keys log n); ``expire`` O(log n) per heap entry it pops; ``orders_sent`` O(arriving
    keys).
    """

    def __init__(self, capacity: int, max_retained: int = 0) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if not isinstance(max_retained, int) or not 0 <= max_retained <= capacity:
            raise ValueError(f"max_retained must be an int in [0, {capacity}], "
                             f"got {max_retained!r}")
        self.capacity = capacity
        self.max_retained = max_retained
        self._lru: OrderedDict[str, None] = OrderedDict()  # ordinary keys
        self._kept: OrderedDict[str, float] = OrderedDict()  # retained key -> until
        self._expiry: list[tuple[float, str]] = []  # heap of (until, key)
        self._pins: Counter[str] = Counter()
        self._arriving: set[str] = set()  # inserted since the last orders_sent

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._kept

    def __len__(self) -> int:
        return len(self._lru) + len(self._kept)

    def holds(self, key: str) -> bool:
        """Whether every worker's host tier holds ``key`` now, not only once this
        step's orders have run. O(1)."""
        return key in self and key not in self._arriving

    def orders_sent(self) -> None:
        """The step's orders went out: once they have run, the workers hold its
        arriving keys (a failed load's key is ``remove``d then). O(arriving keys)."""
        self._arriving.clear()

    def keys(self) -> list[str]:
        """The keys in eviction order (pins aside): ordinary, then retained. O(n)."""
        return [*self._lru, *self._kept]

    def retained(self) -> list[str]:
        """The retained keys, least recently used first. O(retained)."""
        return list(self._kept)

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used, if present. O(1)."""
        if key in self._lru:
            self._lru.move_to_end(key)
        elif key in self._kept:
            self._kept.move_to_end(key)

    def retain(self, keys: list[str], until: float) -> None:
        """Keep the present ``keys`` (a context's chained block keys, in order) behind
        every ordinary key until ``until`` (or a later time a retention already asked),
        as the most recently used retained keys, the first block most recent: a
        context loses its tail before its prefix, which the tail's keys chain on.
        Beyond ``max_retained`` the least recently used retained keys become ordinary.
        O(keys log n)."""
        if self.max_retained == 0:
            return
        for key in reversed(keys):
            if key in self._lru:
                del self._lru[key]
            elif key not in self._kept:
                continue
            if until > self._kept.get(key, float("-inf")):
                self._kept[key] = until
                heapq.heappush(self._expiry, (until, key))
            self._kept.move_to_end(key)
        while len(self._kept) > self.max_retained:
            self._release(next(iter(self._kept)))

    def expire(self, now: float) -> None:
        """End the retentions whose time is up (``until <= now``). O(log n) per heap
        entry popped."""
        while self._expiry and self._expiry[0][0] <= now:
            until, key = heapq.heappop(self._expiry)
            if self._kept.get(key) == until:
                self._release(key)
        if len(self._expiry) > 2 * len(self._kept) + 16:  # drop stale entries
            self._expiry = [(until, key) for key, until in self._kept.items()]
            heapq.heapify(self._expiry)

    def _release(self, key: str) -> None:
        """A retained key becomes the least recently used ordinary key."""
        del self._kept[key]
        self._lru[key] = None
        self._lru.move_to_end(key, last=False)

    def insert(self, key: str, ordinary_only: bool = False) -> Insertion:
        """Add ``key`` as most recently used (or touch it if present), evicting the
        least recently used unpinned key when full; with ``ordinary_only`` (a
        prefetch) only an ordinary key that is neither pinned nor arriving. Refused
        (added False, nothing evicted) when the capacity is 0 or no key may go. An
        added key is arriving."""
        if key in self:
            self.touch(key)
            return Insertion(False, ())
        evicted: tuple[str, ...] = ()
        if len(self) >= self.capacity:
            candidates = self._lru if ordinary_only else chain(self._lru, self._kept)
            victim = next((k for k in candidates if k not in self._pins
                           and not (ordinary_only and k in self._arriving)), None)
            if victim is None:
                return Insertion(False, ())
            self.remove(victim)
            evicted = (victim,)
        self._lru[key] = None
        self._arriving.add(key)
        return Insertion(True, evicted)

    def remove(self, key: str) -> bool:
        """Forget ``key`` (pinned or not); True if it was present. O(1)."""
        if key in self._lru:
            del self._lru[key]
        elif self._kept.pop(key, None) is None:
            return False
        self._arriving.discard(key)
        return True

    def clear(self) -> None:
        """Forget every key and every pin. O(n)."""
        self._lru.clear()
        self._kept.clear()
        self._expiry.clear()
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
        """Raise ``RuntimeError`` naming the first broken invariant (plain raises, so
        ``python -O`` keeps them). O(n)."""
        if len(self) > self.capacity:
            raise RuntimeError(f"{len(self)} keys exceed the capacity of {self.capacity}")
        both = self._lru.keys() & self._kept.keys()
        if both:
            raise RuntimeError(f"keys {list(both)[:3]} are both ordinary and retained")
        if len(self._kept) > self.max_retained:
            raise RuntimeError(f"{len(self._kept)} retained keys exceed the bound of "
                               f"{self.max_retained}")
        entries = set(self._expiry)
        missing = [k for k, until in self._kept.items() if (until, k) not in entries]
        if missing:
            raise RuntimeError(f"retained keys {missing[:3]} have no expiry entry")
        bad = [key for key, count in self._pins.items() if count <= 0]
        if bad:
            raise RuntimeError(f"non-positive pin counts for {bad[:3]}")
        unknown = [key for key in self._arriving if key not in self]
        if unknown:
            raise RuntimeError(f"arriving keys {unknown[:3]} are not in the mirror")
        early = [key for key in self._arriving if key in self._pins]
        if early:
            raise RuntimeError(f"keys {early[:3]} are pinned as host hits before any host "
                               "holds them")


__all__ = ["HostMirror", "Insertion"]
