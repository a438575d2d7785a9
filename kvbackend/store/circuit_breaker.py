"""A circuit breaker: calls to a failing service stop for a while, then one probes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed (every call may go) until a failure opens it for ``first_s`` seconds.

    While open, ``allow`` refuses; once the delay is over it lets one caller
    through as a probe and re-arms the delay, so other callers wait for the
    probe (or for the next delay, should the probe never report). Every failure
    reported while open doubles the delay, up to ``max_s``; any success closes
    the breaker. ``failed`` and ``succeeded`` say when an outage begins and ends,
    so the caller logs one warning per outage.

    Invariants (``check_invariants``):

    * closed  <=>  ``failures == 0``  <=>  ``delay_s == 0``  <=>  ``open_until == 0``;
    * open: ``delay_s == min(max_s, first_s * 2 ** (failures - 1))``, so
      ``first_s <= delay_s <= max_s``.

    Thread-safe; O(1) per call.
    """

    def __init__(self, first_s: float, max_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s, self.max_s, self._clock = first_s, max_s, clock
        self._lock = threading.Lock()
        self.failures = 0  # consecutive failures reported since the breaker last closed
        self.delay_s = 0.0
        self.open_until = 0.0

    @property
    def closed(self) -> bool:
        return self.failures == 0

    def allow(self) -> bool:
        """Whether a call may go now: always when closed; when open, once per delay."""
        with self._lock:
            if self.failures == 0:
                return True
            now = self._clock()
            if now < self.open_until:
                return False
            self.open_until = now + self.delay_s
            return True

    def seconds_to_try(self) -> float:
        """Seconds until ``allow`` lets the next probe through (0: now, or closed)."""
        with self._lock:
            return max(0.0, self.open_until - self._clock()) if self.failures else 0.0

    def failed(self) -> bool:
        """Record a failed call; True if it began an outage (the breaker was closed)."""
        with self._lock:
            began = self.failures == 0
            self.failures += 1
            self.delay_s = self.first_s if began else min(self.max_s, 2 * self.delay_s)
            self.open_until = self._clock() + self.delay_s
            return began

    def succeeded(self) -> bool:
        """Record a successful call; True if it ended an outage."""
        with self._lock:
            ended = self.failures > 0
            self.failures, self.delay_s, self.open_until = 0, 0.0, 0.0
            return ended

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the broken invariant. O(1)."""
        with self._lock:
            if self.failures == 0:
                if self.delay_s != 0.0 or self.open_until != 0.0:
                    raise RuntimeError(f"closed breaker with delay {self.delay_s}, "
                                       f"open until {self.open_until}")
                return
            if self.failures < 0:
                raise RuntimeError(f"negative failure count {self.failures}")
            expected = min(self.max_s, self.first_s * 2.0 ** min(self.failures - 1, 1023))
            if self.delay_s != expected:
                raise RuntimeError(f"delay {self.delay_s} after {self.failures} failures, "
                                   f"expected {expected}")
            if self.open_until <= 0.0:
                raise RuntimeError(f"open breaker without a deadline ({self.open_until})")
