"""Fixed-size rows of pinned host memory, carved from power-of-two slabs.

torch's pinned-memory allocator rounds every allocation up to a power of two and keeps
what is freed cached for reuse. Pinned one by one, the host tier's rows of a model whose
block is 5 MiB (80 layers, 8 KV heads of 128, bf16, 16 tokens) took 8 MiB each: 1.6x the
bytes the tier counts (torch's rounding, by its source; its threshold is configurable
and unbounded by default). ``PinnedRows`` asks torch for power-of-two slabs only (exact
sizes, then) and hands out rows inside them: the memory pinned is the most rows ever
in use, rounded up to whole slabs, each slab leaving less than one row unused.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque

import numpy as np
import torch

ROWS_PER_SLAB = 32  # at least this many rows per slab: under 1/32 of a slab is left over


class PinnedRows:
    """Rows of ``row_nbytes`` bytes (1-D writable uint8 arrays) in pinned host memory.

    A row's slot returns to the free list when the last reference to the row, or to any
    array, memoryview or tensor made from it, is gone: the row is a view of a small
    ctypes buffer that every derived view keeps alive, and a ``weakref.finalize`` on
    that buffer frees the slot. Slabs are kept for reuse, never unpinned (as torch keeps
    its own pinned blocks). ``pin=False`` gives plain memory (tests on machines without
    a GPU).

    Invariants (``check_invariants``): slabs are ``slab_nbytes`` each, a power of two
    of at least ``ROWS_PER_SLAB`` rows; the free slots are distinct slots of those
    slabs; every slot is free or held (by one live row), never both. Thread-safe (rows may be
    dropped on any thread). Complexity: O(1) per row, plus one slab per
    ``rows_per_slab`` rows.
    """

    def __init__(self, row_nbytes: int, *, pin: bool = True) -> None:
        if not isinstance(row_nbytes, int) or row_nbytes <= 0:
            raise ValueError(f"row_nbytes must be a positive int, got {row_nbytes!r}")
        self.row_nbytes, self.pin = row_nbytes, pin
        self.slab_nbytes = 1 << (ROWS_PER_SLAB * row_nbytes - 1).bit_length()
        self.rows_per_slab = self.slab_nbytes // row_nbytes
        self._slabs: list[np.ndarray] = []
        self._free: list[tuple[int, int]] = []  # (slab, row index), taken from the end
        self._held: set[tuple[int, int]] = set()  # slots of live rows
        # Slots whose rows died: finalizers only append here (deque appends are atomic),
        # so one that runs inside a locked section (a garbage collection) changes nothing.
        self._returned: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    @property
    def rows_in_use(self) -> int:
        with self._lock:
            self._reclaim()
            return len(self._held)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of all slabs: what this pool holds of the machine's memory."""
        return len(self._slabs) * self.slab_nbytes

    def take(self) -> np.ndarray:
        """A row no live row shares memory with; its bytes are undefined."""
        with self._lock:
            self._reclaim()
            if not self._free:
                self._add_slab()
            slab, index = self._free.pop()
            self._held.add((slab, index))
        owner = (ctypes.c_uint8 * self.row_nbytes).from_buffer(
            self._slabs[slab], index * self.row_nbytes)
        weakref.finalize(owner, self._give_back, slab, index)
        return np.frombuffer(owner, dtype=np.uint8)

    def check_invariants(self) -> None:
        with self._lock:
            self._reclaim()
            for slab in self._slabs:
                if slab.nbytes != self.slab_nbytes:
                    raise AssertionError(f"a slab of {slab.nbytes} bytes, not {self.slab_nbytes}")
            if self.slab_nbytes & (self.slab_nbytes - 1) or \
                    self.rows_per_slab < ROWS_PER_SLAB:
                raise AssertionError(f"slabs of {self.slab_nbytes} bytes hold "
                                     f"{self.rows_per_slab} rows")
            free = set(self._free)
            if len(free) != len(self._free):
                raise AssertionError("a slot is free twice")
            if free & self._held:
                raise AssertionError(f"slots both free and held: {sorted(free & self._held)[:4]}")
            every = {(slab, index) for slab in range(len(self._slabs))
                     for index in range(self.rows_per_slab)}
            if free | self._held != every:
                raise AssertionError("the free and held slots are not the slabs' slots")

    def _add_slab(self) -> None:
        """One more slab (caller holds the lock): a power of two, so torch pins it exactly."""
        slab = torch.empty(self.slab_nbytes, dtype=torch.uint8, pin_memory=self.pin).numpy()
        number = len(self._slabs)
        self._slabs.append(slab)
        self._free.extend((number, index) for index in reversed(range(self.rows_per_slab)))

    def _give_back(self, slab: int, index: int) -> None:
        self._returned.append((slab, index))

    def _reclaim(self) -> None:
        """Free the slots of the rows that died (caller holds the lock)."""
        while self._returned:
            slot = self._returned.popleft()
            self._held.discard(slot)
            self._free.append(slot)


__all__ = ["PinnedRows", "ROWS_PER_SLAB"]
