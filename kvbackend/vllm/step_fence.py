"""Which scheduled steps have run, and which blocks a step in flight may still use.

Under async scheduling the engine schedules step N+1 while step N runs. vLLM's
workers run steps, their block copies and their KV writes in order on one stream,
so a block freed while step N still writes or reads it may be handed out at once:
whoever gets it writes in step N+1 or later. A KV connector that loads outside
that order (its own copy stream, RDMA) breaks this for the blocks it loads into:
it may fill one while step N still uses it. vLLM defers every block free for
such connectors (``Scheduler.defer_block_free``). kvbackend frees at once and
keeps only the load destinations apart: with ``track`` the manager marks the
blocks each step uses as it lets go of them (a request's table when it is freed,
a copy's source when its step is scheduled), and an admission that would load
into a block a step in flight still uses waits a step (``busy``). A freed block
may still serve a computing request at once, so no request waits for blocks it
could compute into (deferring every free starved one whose partial hit's copy
source would, a step later, have made room for its next block).

Steps are counted as vLLM's own fence counts them: only those that schedule
tokens (an empty step runs nothing). The scheduler reports both ends
(``step_scheduled`` once ``schedule`` returns, ``step_processed`` as an output
arrives, in step order).

Invariants (``check_invariants``): ``processed <= scheduled``; no block is marked
used by a step after the one being scheduled (``next_step``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class StepFence:
    """Step counters; with ``track``, the last step each block may be used in."""

    def __init__(self, num_blocks: int, track: bool) -> None:
        self.track = track
        self.scheduled = 0  # steps that scheduled tokens so far
        self.processed = 0  # of those, the ones whose output the scheduler has taken
        self._last_use = np.zeros(num_blocks if track else 0, dtype=np.int64)

    @property
    def next_step(self) -> int:
        """The number the step being scheduled gets once it is handed out."""
        return self.scheduled + 1

    def step_scheduled(self) -> None:
        """A step with scheduled tokens was handed to the workers. O(1)."""
        self.scheduled += 1

    def step_processed(self) -> None:
        """The oldest step in flight ran: its output is in. O(1)."""
        if self.processed >= self.scheduled:
            raise RuntimeError("an output arrived for a step that was never scheduled; "
                               "this indicates a bug")
        self.processed += 1

    def has_run(self, step: int) -> bool:
        """Whether step ``step`` (1 for the first step that scheduled tokens) ran."""
        return step <= self.processed

    def used(self, block_ids: Iterable[int], step: int) -> None:
        """Blocks step ``step`` may use (no-op without ``track``). O(len(block_ids))."""
        if self.track:
            ids = np.fromiter(block_ids, dtype=np.int64)
            self._last_use[ids] = np.maximum(self._last_use[ids], step)

    def busy(self, block_ids: Iterable[int]) -> list[int]:
        """Those of ``block_ids`` a step that has not run may use. O(len(block_ids))."""
        if not self.track:
            return []
        ids = np.fromiter(block_ids, dtype=np.int64)
        return ids[self._last_use[ids] > self.processed].tolist()

    def check_invariants(self) -> None:
        assert 0 <= self.processed <= self.scheduled, (self.processed, self.scheduled)
        assert not (self._last_use > self.scheduled + 1).any(), (
            "a block is marked used by a step not scheduled")
