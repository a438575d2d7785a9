"""Read-behind for the remote tier: loads leave the caller's thread at once."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence

from kvbackend.store.remote_tier import RemoteTier

logger = logging.getLogger("kvbackend.store")

# One fetched batch: its tag, the verified payload of each key (None: a miss), seconds spent.
Fetched = tuple[Hashable, list[memoryview | None], float]


class RemoteReader:
    """Fetches batches of blocks from a ``RemoteTier`` on one background thread.

    ``submit(tag, keys)`` queues a batch and returns at once; ``take_done`` hands
    back the batches fetched since the last call, never waiting. Each batch is
    one ``get_many`` (one round trip, every value verified), so a paused or dead
    server costs the thread one timeout per outage, then the tier's breaker answers
    misses at once: no batch waits forever. After ``close`` no batch is fetched: those
    still queued come back as all misses, so every submitted tag comes back
    exactly once.

    Invariants (``check_invariants``): every tag submitted and not yet taken is in
    exactly one of the queue, the batch being fetched, and the done list; a batch
    comes back with one entry per key. Thread-safe; ``submit`` is O(keys),
    ``take_done`` O(batches done).
    """

    def __init__(self, tier: RemoteTier) -> None:
        self.tier = tier
        self._queue: deque[tuple[Hashable, list[str]]] = deque()
        self._fetching: tuple[Hashable, list[str]] | None = None
        self._done: list[Fetched] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvbackend-remote-reader",
                                        daemon=True)
        self._thread.start()

    def submit(self, tag: Hashable, keys: Sequence[str]) -> None:
        """Queue a batch; its result comes back from ``take_done`` under ``tag``."""
        with self._cond:
            if self._closed:
                self._done.append((tag, [None] * len(keys), 0.0))
            else:
                self._queue.append((tag, list(keys)))
                self._cond.notify_all()

    def take_done(self) -> list[Fetched]:
        """The batches fetched since the last call (tag, payloads, seconds)."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def pending(self) -> int:
        """Batches submitted whose result ``take_done`` has not handed back yet."""
        with self._cond:
            return len(self._queue) + (self._fetching is not None) + len(self._done)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is queued or being fetched; False on timeout (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._fetching is None,
                                       timeout_s)

    def close(self, timeout_s: float | None = 5.0) -> None:
        """Stop fetching: the batches still queued come back as all misses; waits at most
        ``timeout_s`` for the one being fetched."""
        with self._cond:
            self._closed = True
            while self._queue:
                tag, keys = self._queue.popleft()
                self._done.append((tag, [None] * len(keys), 0.0))
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the broken invariant. O(batches)."""
        with self._cond:
            tags = [t for t, _ in self._queue] + [t for t, _, _ in self._done]
            if self._fetching is not None:
                tags.append(self._fetching[0])
            if len(tags) != len(set(tags)):
                raise RuntimeError(f"a tag is pending twice: {tags}")
            if self._closed and self._queue:
                raise RuntimeError("batches queued after close")

    def _next_batch(self) -> tuple[Hashable, list[str]] | None:
        """Wait for a batch and mark it as being fetched; None once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            self._fetching = self._queue.popleft() if self._queue else None
            return self._fetching

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            tag, keys = batch
            start = time.perf_counter()
            try:
                payloads = self.tier.get_many(keys)
            except Exception:  # noqa: BLE001 - the thread must outlive a bug in one batch
                logger.exception("kvbackend: remote tier reader: a batch of %d blocks failed",
                                 len(keys))
                payloads = [None] * len(keys)
            with self._cond:
                self._done.append((tag, payloads, time.perf_counter() - start))
                self._fetching = None
                self._cond.notify_all()


__all__ = ["RemoteReader"]
