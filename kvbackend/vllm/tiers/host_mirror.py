"""The scheduler's copy of what every worker's host tier holds.

The scheduler alone decides what the workers keep in host memory: each
eviction it makes here reaches the workers as a drop order, applied before any
put of the same step, and every key's ``weight`` (its payload's size, in units the
caller picks) adds up to at most ``capacity``, what each worker's host tier holds, so
a worker never evicts on its own and every worker holds exactly these keys once
the step's orders have run. Until then the keys inserted in the step are
*arriving*: a load in the step promotes them, or a save puts them, and no host
tier holds them yet (a read that fails never puts them). Only keys the workers
``holds`` are host hits.

Retention (``kv_retain_s``) reaches the host tier here: a retained key is evicted
only once no unpinned ordinary key is left, until its time is up; then, or when
the retained keys weigh more than ``max_retained`` (the oldest-used goes first), it
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
    """Block keys in eviction order, weighing at most ``capacity`` together: ordinary
    keys least recently used first, then retained keys least recently used first.

    A pinned key (a lookup or a load in flight lists it) is never evicted; pins are
    counted, so several requests may pin one key. A key ``insert`` added stays
    arriving until ``orders_sent``. ``retain(keys, until)`` keeps keys behind every
    ordinary key until ``expire(now)`` sees ``until`` pass (see the module docstring).

    Invariants (``check_invariants``):
      * ``used``, the keys' weights summed, ``<= capacity``; a key is ordinary or
        retained, never both
      * the retained keys weigh at most ``max_retained``, each has an expiry heap
        entry ``(until, key)`` (the heap may also hold stale entries)
      * every pin count is positive
      * every arriving key is a key, and none is pinned (only held keys are host hits)
    Complexity: O(1) per lookup, touch, remove and pin; ``insert`` O(1 + victims +
    pinned (and, ``ordinary_only``, arriving) keys it skips while looking for them); ``retain``
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
        self._weights: dict[str, int] = {}  # key -> its weight
        self.used = 0  # the keys' weights summed
        self._kept_weight = 0  # the retained keys' weights summed

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
        Past a weight of ``max_retained`` the least recently used retained keys become
        ordinary.
        O(keys log n)."""
        if self.max_retained == 0:
            return
        for key in reversed(keys):
            if key in self._lru:
                del self._lru[key]
                self._kept_weight += self._weights[key]
            elif key not in self._kept:
                continue
            if until > self._kept.get(key, float("-inf")):
                self._kept[key] = until
                heapq.heappush(self._expiry, (until, key))
            self._kept.move_to_end(key)
        while self._kept_weight > self.max_retained:
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
        self._kept_weight -= self._weights[key]
        self._lru[key] = None
        self._lru.move_to_end(key, last=False)

    def insert(self, key: str, ordinary_only: bool = False, weight: int = 1) -> Insertion:
        """Add ``key`` of ``weight`` as most recently used (or touch it if present),
        evicting the least recently used unpinned keys it does not fit beside; with
        ``ordinary_only`` (a prefetch) only ordinary keys neither pinned nor arriving.
        Refused (added False, nothing evicted) when those keys cannot make room. An
        added key is arriving."""
        if key in self:
            self.touch(key)
            return Insertion(False, ())
        if not isinstance(weight, int) or weight < 1:
            raise ValueError(f"a key's weight must be an int >= 1, got {weight!r}")
        if weight > self.capacity:
            return Insertion(False, ())
        excess, victims = self.used + weight - self.capacity, []
        if excess > 0:
            candidates = self._lru if ordinary_only else chain(self._lru, self._kept)
            for k in candidates:
                if k not in self._pins and not (ordinary_only and k in self._arriving):
                    victims.append(k)
                    excess -= self._weights[k]
                    if excess <= 0:
                        break
            if excess > 0:
                return Insertion(False, ())
            for victim in victims:
                self.remove(victim)
        self._lru[key] = None
        self._weights[key] = weight
        self.used += weight
        self._arriving.add(key)
        return Insertion(True, tuple(victims))

    def remove(self, key: str) -> bool:
        """Forget ``key`` (pinned or not); True if it was present. O(1)."""
        if key in self._lru:
            del self._lru[key]
        elif self._kept.pop(key, None) is None:
            return False
        else:
            self._kept_weight -= self._weights[key]
        self.used -= self._weights.pop(key)
        self._arriving.discard(key)
        return True

    def clear(self) -> None:
        """Forget every key and every pin. O(n)."""
        self._lru.clear()
        self._kept.clear()
        self._expiry.clear()
        self._pins.clear()
        self._arriving.clear()
        self._weights.clear()
        self.used = self._kept_weight = 0

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
        if self._weights.keys() != set(self._lru) | set(self._kept):
            raise RuntimeError("the weighed keys are not the mirror's keys")
        if self.used != sum(self._weights.values()) or self.used > self.capacity:
            raise RuntimeError(f"used {self.used} of {self.capacity}: not the keys' weights "
                               f"{sum(self._weights.values())}, or over the capacity")
        both = self._lru.keys() & self._kept.keys()
        if both:
            raise RuntimeError(f"keys {list(both)[:3]} are both ordinary and retained")
        kept = sum(self._weights[k] for k in self._kept)
        if self._kept_weight != kept or kept > self.max_retained:
            raise RuntimeError(f"retained keys weigh {kept} (counted {self._kept_weight}), "
                               f"bound {self.max_retained}")
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
