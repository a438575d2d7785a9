"""A background health check: while a circuit breaker is open, a thread of its own probes
the service, so no caller ever waits on a service that stopped answering."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvbackend.store.circuit_breaker import CircuitBreaker

logger = logging.getLogger("kvbackend.store")


class HealthProbe:
    """Probes the service behind ``breaker`` on its own thread while the breaker is open.

    Callers go to the service only while ``breaker.closed``; otherwise they answer
    without it (a miss), at once. A caller reports a failed call with ``failed()``:
    that opens the breaker and starts the probe thread, unless it runs. The thread
    waits out the breaker's delay, calls ``ping()`` (True: the service answered;
    it must not raise), reports the result to the breaker (a failure doubles the
    delay, up to its maximum) and, once the breaker is closed, calls ``on_back()``
    if its own probe closed it, and exits. So a caller waits on a dead service at
    most once per outage (the call that finds it out), never once per probe.
    ``stop()`` ends the probing and closes the breaker: the next call tries the
    service again.

    Invariants (``check_invariants``): the breaker's; while the breaker is open, a
    probe thread runs. Thread-safe; ``failed`` and ``stop`` are O(1) and never wait
    for the service.
    """

    def __init__(self, breaker: CircuitBreaker, ping: Callable[[], bool],
                 on_back: Callable[[], None], name: str) -> None:
        self.breaker, self.name = breaker, name
        self._ping, self._on_back = ping, on_back
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None  # the running thread's; None: none runs

    def failed(self) -> bool:
        """Record a failed call; True if it began an outage."""
        with self._lock:
            began = self.breaker.failed()
            if self._stop is None:
                self._stop = threading.Event()
                threading.Thread(target=self._run, args=(self._stop,), name=self.name,
                                 daemon=True).start()
            return began

    def stop(self) -> None:
        """Stop probing (a probe in flight is ignored) and close the breaker."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None
            self.breaker.succeeded()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the broken invariant. O(1)."""
        self.breaker.check_invariants()
        with self._lock:
            if not self.breaker.closed and self._stop is None:
                raise RuntimeError(f"{self.name}: breaker open, no probe running")

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self._lock:
                if stop.is_set():
                    return
                if self.breaker.closed:  # a caller's call succeeded meanwhile
                    self._stop = None
                    return
            if stop.wait(self.breaker.seconds_to_try()) or not self.breaker.allow():
                continue  # stopped, or a caller's failure re-armed the delay
            try:
                answered = self._ping()
            except Exception:  # noqa: BLE001 - a bug in ping must not end the probing
                logger.exception("kvbackend: %s: the health check failed", self.name)
                answered = False
            with self._lock:
                if stop.is_set():
                    return
                if not answered:
                    self.breaker.failed()
                    continue
                back = self.breaker.succeeded()
                self._stop = None
            if back:
                self._on_back()
            return


__all__ = ["HealthProbe"]
