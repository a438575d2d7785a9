"""A fixed pool of KV blocks with reference and hold counts.

Block ids are the ints ``0..num_blocks-1`` that index the engine's KV tensor.
Block 0 may be reserved as the engine's null block: it is never handed out.

Every holder of a block takes one *reference*. Holders that forbid eviction --
a running sequence, or a tree node that is locked or pinned -- also take one
*hold*. So a block is in exactly one of three states:

    free       ref_cnt == 0                    (on the free list)
    evictable  ref_cnt > 0 and hold_cnt == 0   (cached by unlocked tree nodes only)
    held       hold_cnt > 0

Invariants (checked by ``check_invariants``):
    * 0 <= hold_cnt[b] <= ref_cnt[b] for every block b
    * b is on the free list  <=>  ref_cnt[b] == 0 and b is not the null block
    * num_evictable == #{b : ref_cnt[b] > 0 and hold_cnt[b] == 0}
    * num_free + num_evictable + num_held == num_usable_blocks
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np


class BlockPool:
    """Reference-counted block ids with an O(1) free list.

    The pool never evicts by itself: ``allocate`` takes free blocks only; the
    owner of the cache frees evictable blocks first (see ``RadixTree.evict``).
    ``on_free``, when set, is told of each block that returns to the free list
    (it may release other blocks in turn).
    """

    def __init__(self, num_blocks: int, *, reserve_null_block: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be an int >= {1 + reserve_null_block}, "
                             f"got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.null_block_id = 0 if reserve_null_block else None
        first = 1 if reserve_null_block else 0
        self.ref_cnt = [0] * num_blocks
        self.hold_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(first, num_blocks))
        self.num_evictable = 0
        self.on_free: Callable[[int], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block_id is not None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_usable_blocks - self.num_free - self.num_evictable

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks, each with one reference and one hold.

        Returns ``None`` (and takes nothing) when fewer than ``n`` are free.
        Complexity: O(n).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        popleft, ref_cnt, hold_cnt = self._free.popleft, self.ref_cnt, self.hold_cnt
        ids = [popleft() for _ in range(n)]
        for b in ids:
            ref_cnt[b] = 1
            hold_cnt[b] = 1
        return ids

    def ref(self, ids: Iterable[int] | np.ndarray, *, hold: bool) -> None:
        """Add one reference (and one hold if ``hold``) to each of ``ids``. O(len(ids))."""
        for b in _ints(ids):
            self._check_id(b)
            if self.ref_cnt[b] == 0:
                raise ValueError(f"block {b} is free: take blocks from allocate(), not ref()")
            if hold:
                if self.hold_cnt[b] == 0:
                    self.num_evictable -= 1
                self.hold_cnt[b] += 1
            self.ref_cnt[b] += 1

    def unref(self, ids: Iterable[int] | np.ndarray, *, hold: bool) -> int:
        """Drop one reference (and one hold if ``hold``) from each of ``ids``.

        Blocks whose count reaches zero go back to the free list. Returns how many
        were freed. Complexity: O(len(ids)).
        """
        freed = 0
        for b in _ints(ids):
            self._check_id(b)
            if self.ref_cnt[b] == 0 or (hold and self.hold_cnt[b] == 0):
                raise ValueError(f"double release of block {b}")
            was_evictable = self.hold_cnt[b] == 0
            self.ref_cnt[b] -= 1
            if hold:
                self.hold_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
                freed += 1
                self.num_evictable -= was_evictable
                if self.on_free is not None:
                    self.on_free(b)
            elif self.hold_cnt[b] == 0 and not was_evictable:
                self.num_evictable += 1
        return freed

    def hold(self, ids: Iterable[int] | np.ndarray) -> None:
        """Turn one existing reference of each block into a held one. O(len(ids))."""
        for b in _ints(ids):
            if self.hold_cnt[b] >= self.ref_cnt[b]:
                raise RuntimeError(f"block {b}: hold without a matching reference indicates a bug")
            if self.hold_cnt[b] == 0:
                self.num_evictable -= 1
            self.hold_cnt[b] += 1

    def unhold(self, ids: Iterable[int] | np.ndarray) -> None:
        """Turn one held reference of each block back into a plain one. O(len(ids))."""
        for b in _ints(ids):
            if self.hold_cnt[b] == 0:
                raise RuntimeError(f"block {b}: unhold of a block nobody holds indicates a bug")
            self.hold_cnt[b] -= 1
            if self.hold_cnt[b] == 0:
                self.num_evictable += 1

    def _check_id(self, b: int) -> None:
        if not (0 <= b < self.num_blocks) or b == self.null_block_id:
            first = 0 if self.null_block_id is None else 1
            raise ValueError(f"block id {b!r} out of range [{first}, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Assert every invariant in the module docstring. O(num_blocks)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        pairs = list(zip(self.ref_cnt, self.hold_cnt))
        if any(not 0 <= held <= refs for refs, held in pairs):
            raise RuntimeError("hold_cnt must lie in [0, ref_cnt]")
        if self.null_block_id is not None and pairs[self.null_block_id] != (0, 0):
            raise RuntimeError("the null block must never be referenced")
        unreferenced = {b for b, (refs, _) in enumerate(pairs) if refs == 0} - {self.null_block_id}
        if unreferenced != free:
            raise RuntimeError(f"free list {sorted(free)} != unreferenced {sorted(unreferenced)}")
        evictable = sum(1 for refs, held in pairs if refs > 0 and held == 0)
        if evictable != self.num_evictable:
            raise RuntimeError(f"num_evictable {self.num_evictable} != recount {evictable}")
        held = sum(1 for _, h in pairs if h > 0)
        if len(free) + evictable + held != self.num_usable_blocks:
            raise RuntimeError(f"free {len(free)} + evictable {evictable} + held {held} "
                               f"!= usable {self.num_usable_blocks}")


def _ints(ids: Iterable[int] | np.ndarray) -> Iterable[int]:
    """Block ids as Python ints: the tree passes int64 arrays, while the free list and
    the engine deal in ints only. O(len(ids))."""
    return ids.tolist() if isinstance(ids, np.ndarray) else ids
