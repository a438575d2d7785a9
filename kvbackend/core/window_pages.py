"""Sliding-window pages: a block's KV in sliding-window layers, kept while a window
reaches it.

From position p a sliding-window layer attends to positions (p - window, p] only.
kvbackend's logical block (the unit of its tree and pool) is the block of the
layers that attend to everything; its pages in the ``num_groups`` sliding-window
groups are further blocks of the same pool, held here for the caller
(``extra_blocks`` of ``PrefixCache.open_sequence`` / ``extend``). A block keeps them
while a live sequence's window reaches it (*held*), then while the pool has room
(*idle*): it is the cache's ``Reclaimer``, so when the pool falls short the
longest-idle pages and the tree's least recently used blocks go in one order (a
block turns idle with a stamp of the tree's use clock: ``PrefixCache._allocate``). A
block the pool frees gives its pages back with it (``BlockPool.on_free``).

A hit of ``h`` tokens reads the pages of the blocks holding positions
[h - window + 1, h) (from ``window_start(h)`` on): ``longest_hit`` cuts a match
back to the longest prefix whose window blocks all have their pages.

Invariants (``check_invariants``):
    * every page is listed once, under one block, and is a caller block of the cache
    * held[b] > 0  =>  b has pages
    * b is idle  <=>  b has pages and held[b] == 0; idle stamps increase in idle order
    * a block with pages is referenced in the pool (a freed block drops them)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvbackend.core.prefix_cache import PrefixCache
from kvbackend.core.token_ops import cdiv


class WindowPages:
    """Each logical block's pages in the sliding-window groups, with their holds.
    O(1) per block and page; ``longest_hit`` O(blocks of the match)."""

    def __init__(self, cache: PrefixCache, num_groups: int, window: int,
                 on_dropped: Callable[[int], None] | None = None) -> None:
        if num_groups < 1 or window < 1:
            raise ValueError(f"need >= 1 sliding-window group and a window >= 1 token, got "
                             f"{num_groups} groups, window {window}")
        self.cache, self.num_groups, self.window = cache, num_groups, window
        self.block_size = cache.block_size
        self.on_dropped = on_dropped  # told of each block whose idle pages were reclaimed
        self._pages: dict[int, list[int]] = {}
        self._held: Counter[int] = Counter()
        self._idle: OrderedDict[int, int] = OrderedDict()  # block -> idle since; oldest first
        cache.reclaimer = self
        cache.pool.on_free = self._block_freed

    # ---------------------------------------------------------------- queries
    def pages(self, block_id: int) -> list[int]:
        """``block_id``'s page in every sliding-window group; KeyError if it has none."""
        return self._pages[block_id]

    def has_pages(self, block_id: int) -> bool:
        return block_id in self._pages

    @property
    def num_idle(self) -> int:
        """Blocks whose pages the pool may take back (``num_groups`` pages each). O(1)."""
        return len(self._idle)

    @property
    def num_reclaimable(self) -> int:
        return self.num_groups * len(self._idle)

    def oldest_key(self) -> tuple[int, int, int, int] | None:
        """The longest-idle block's pages in the tree's eviction order: as an ordinary
        leaf's full blocks last used when they turned idle. O(1)."""
        if not self._idle:
            return None
        return (0, 0, 1, next(iter(self._idle.values())))

    def reclaim_oldest(self) -> None:
        """Free the longest-idle block's pages. O(num_groups)."""
        b, _ = self._idle.popitem(last=False)
        self._free_pages(b)
        if self.on_dropped is not None:
            self.on_dropped(b)

    def window_start(self, num_tokens: int) -> int:
        """The first block a sequence of ``num_tokens`` computed tokens still reads in
        the sliding-window layers (vLLM's ``get_num_skipped_tokens`` // block size)."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def longest_hit(self, block_ids: Sequence[int], num_tokens: int) -> int:
        """The longest ``h <= num_tokens`` whose window blocks (``block_ids[window_start(h):
        cdiv(h, block_size)]``, a partial last one included) all have pages. A block
        without pages at index m rules out every h > m * block_size. O(blocks)."""
        h = num_tokens
        while h:
            missing = [i for i in range(self.window_start(h), cdiv(h, self.block_size))
                       if block_ids[i] not in self._pages]
            if not missing:
                return h
            h = missing[-1] * self.block_size
        return 0

    # ---------------------------------------------------------------- changes
    def give(self, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """New blocks of one sequence, with ``num_groups`` fresh pages each (the caller's
        blocks of the cache), held by that sequence. O(pages)."""
        g = self.num_groups
        if len(pages) != g * len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks need {g * len(block_ids)} pages, "
                             f"got {len(pages)}")
        for i, b in enumerate(block_ids):
            if b in self._pages:
                raise RuntimeError(f"block {b} has pages already; this indicates a bug")
            self._pages[b] = list(pages[i * g:(i + 1) * g])
            self._held[b] = 1

    def hold(self, block_ids: Iterable[int]) -> None:
        """One more live window reaches each block (which must have pages). O(blocks)."""
        for b in block_ids:
            if b not in self._pages:
                raise RuntimeError(f"block {b} has no sliding-window pages to hold; this "
                                   "indicates a bug")
            self._held[b] += 1
            self._idle.pop(b, None)

    def unhold(self, block_ids: Iterable[int]) -> None:
        """One window fewer reaches each block; unreached, a block turns idle. O(blocks)."""
        for b in block_ids:
            if self._held[b] <= 0:
                raise RuntimeError(f"block {b}: sliding-window pages released more often than "
                                   "held; this indicates a bug")
            self._held[b] -= 1
            if not self._held[b]:
                del self._held[b]
                self._idle[b] = self.cache.tree.use_stamp()

    def _block_freed(self, block_id: int) -> None:
        """The pool freed ``block_id``: its pages go with it (a page itself has none)."""
        if block_id not in self._pages:
            return
        if block_id in self._held:
            raise RuntimeError(f"block {block_id} was freed while a window holds its pages; "
                               "this indicates a bug")
        del self._idle[block_id]
        self._free_pages(block_id)

    def _free_pages(self, block_id: int) -> None:
        self.cache.free_blocks(self._pages.pop(block_id))

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken invariant. O(blocks with pages)."""
        listed = [p for pages in self._pages.values() for p in pages]
        if len(set(listed)) != len(listed):
            raise RuntimeError("a sliding-window page is listed twice")
        if not set(listed) <= self.cache.caller_blocks:
            raise RuntimeError("a sliding-window page is not a caller block of the cache")
        if any(len(p) != self.num_groups for p in self._pages.values()):
            raise RuntimeError("a block has the wrong number of sliding-window pages")
        if not set(self._held) <= self._pages.keys():
            raise RuntimeError("a block without pages is held")
        if any(n <= 0 for n in self._held.values()):
            raise RuntimeError("a hold count is not positive")
        if set(self._idle) != self._pages.keys() - self._held.keys():
            raise RuntimeError("the idle blocks are not those with pages and no hold")
        stamps = list(self._idle.values())
        if stamps != sorted(stamps):
            raise RuntimeError("idle blocks are not ordered by when they turned idle")
        if any(self.cache.pool.ref_cnt[b] == 0 for b in self._pages):
            raise RuntimeError("a free block still has sliding-window pages")
