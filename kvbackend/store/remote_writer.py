"""Write-behind for the remote tier: saves leave the caller's thread at once."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvbackend.store.remote_tier import RemoteTier
from kvbackend.store.tier import Payload, payload_nbytes

logger = logging.getLogger("kvbackend.store")


class RemoteWriter:
    """Sends batches of blocks to a ``RemoteTier`` from one background thread.

    ``submit`` queues a batch and returns at once (the caller must not change the
    payloads afterwards); a batch that would take the queue over ``max_bytes`` is
    dropped and counted: a dropped save is a future miss, never a wait. The thread
    asks the server which keys it already holds (one round trip, no payload
    bytes) and sends only the others (one more). A dead server costs the thread,
    not the caller: the tier's breaker turns its calls into misses.

    Invariants (``check_invariants``): ``queued_bytes`` is the payload bytes of
    the batches waiting and of the one being sent, and ``0 <= queued_bytes <= max_bytes``.
    Thread-safe; ``submit`` is O(blocks).
    """

    def __init__(self, tier: RemoteTier, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.tier, self.max_bytes = tier, max_bytes
        self.queued_bytes = 0
        self._queue: deque[tuple[list[tuple[str, Payload, int]], int]] = deque()
        self._cond = threading.Condition()
        self._sending = 0  # payload bytes of the batch the thread took from the queue
        self._closed = False
        self._counters = dict(submitted=0, dropped=0, skipped_present=0, sent=0, failed=0)
        self._thread = threading.Thread(target=self._run, name="kvbackend-remote-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, blocks: Sequence[tuple[str, Payload, int]]) -> bool:
        """Queue (key, payload, num_tokens) blocks; False if dropped (queue full or closed)."""
        batch = list(blocks)
        nbytes = sum(payload_nbytes(p) for _, p, _ in batch)
        with self._cond:
            if self._closed or self.queued_bytes + nbytes > self.max_bytes:
                self._counters["dropped"] += len(batch)
                return False
            self._queue.append((batch, nbytes))
            self.queued_bytes += nbytes
            self._counters["submitted"] += len(batch)
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued batch was sent (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.queued_bytes == 0, timeout_s)

    def close(self, timeout_s: float | None = 5.0) -> None:
        """Send what is queued (waiting at most ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self._counters, "queued_bytes": self.queued_bytes}

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the broken invariant. O(queue)."""
        with self._cond:
            waiting = [n for _, n in self._queue]
            if self.queued_bytes != sum(waiting) + self._sending:
                raise RuntimeError(f"queued_bytes {self.queued_bytes} != waiting {waiting} "
                                   f"+ sending {self._sending}")
            if not 0 <= self.queued_bytes <= self.max_bytes:
                raise RuntimeError(f"queued_bytes {self.queued_bytes} outside "
                                   f"[0, {self.max_bytes}]")

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, self._sending = self._queue.popleft()
            try:
                sent, present = self._send(batch)
            except Exception:  # noqa: BLE001 - the thread must outlive a bug in one batch
                logger.exception("kvbackend: remote tier writer: a batch of %d blocks failed",
                                 len(batch))
                sent, present = 0, 0
            with self._cond:
                self.queued_bytes -= self._sending
                self._sending = 0
                self._counters["sent"] += sent
                self._counters["skipped_present"] += present
                self._counters["failed"] += len(batch) - sent - present
                self._cond.notify_all()

    def _send(self, batch: list[tuple[str, Payload, int]]) -> tuple[int, int]:
        """Sends the blocks the server lacks; returns (sent, already present)."""
        present = self.tier.present_many([key for key, _, _ in batch])
        missing = [block for block, there in zip(batch, present) if not there]
        return (self.tier.put_many(missing) if missing else 0), len(batch) - len(missing)
