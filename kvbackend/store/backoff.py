"""Retry delays after failures, per scope (a filesystem, a directory)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Backoff:
    """After a failure in a scope, that scope is blocked for a delay that doubles with
    each further failure, from ``first_s`` up to ``max_s``; a success clears it.

    Thread-safe. O(1) per call; memory O(#scopes currently failing).
    """

    def __init__(self, first_s: float, max_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= first_s <= max_s:
            raise ValueError(f"need 0 <= first_s <= max_s, got {first_s} and {max_s}")
        self.first_s, self.max_s, self._clock = first_s, max_s, clock
        self._lock = threading.Lock()
        self._state: dict[str, tuple[float, float]] = {}  # scope -> (blocked until, delay)

    def blocked(self, *scopes: str) -> bool:
        now = self._clock()
        with self._lock:
            return any(now < self._state.get(s, (0.0, 0.0))[0] for s in scopes)

    def failed(self, scope: str) -> float:
        """Record a failure in ``scope``; returns the delay before the next try."""
        with self._lock:
            previous = self._state.get(scope, (0.0, 0.0))[1]
            delay = min(self.max_s, 2 * previous) if previous else self.first_s
            self._state[scope] = (self._clock() + delay, delay)
            return delay

    def succeeded(self, *scopes: str) -> None:
        with self._lock:
            for scope in scopes:
                self._state.pop(scope, None)
