"""A logical block's pages in further KV-cache groups, held while in use, then idle.

kvbackend's logical block (the unit of its tree and pool) is the block of the
layers that attend to everything. A model's other groups need a block's page only
for a while: a sliding-window group while a live window reaches the block
(``WindowPages``), a Mamba / linear-attention state group while a request's state
runs through the block or a hit resumes from the state it holds. Their pages, one
per group (``num_groups``), are further blocks of the same pool, held here for the
caller (``extra_blocks`` of ``PrefixCache.open_sequence`` / ``extend``, or
``PrefixCache.allocate_blocks``). A block keeps them while held, then while the
pool has room (*idle*), if ``keep_idle`` says a reader may still want them (by
default always); otherwise they go back at once. This is the cache's
``Reclaimer``: when the pool falls short, the longest-idle pages and the tree's
least recently used blocks go in one order (a block turns idle with a stamp of the
tree's use clock: ``PrefixCache._allocate``). A block the pool frees gives its
pages back with it (``BlockPool.on_free``).

Invariants (``check_invariants``):
    * every page is listed once, under one block, and is a caller block of the cache
    * held[b] > 0  =>  b has pages
    * b is idle  <=>  b has pages and held[b] == 0; idle stamps increase in idle order
    * b is idle  =>  keep_idle(b)
    * a block with pages is referenced in the pool (a freed block drops them)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvbackend.core.prefix_cache import PrefixCache


class GroupPages:
    """Each logical block's pages in ``num_groups`` further groups, with their holds.
    O(1) per block and page."""

    def __init__(self, cache: PrefixCache, num_groups: int,
                 on_dropped: Callable[[int], None] | None = None,
                 keep_idle: Callable[[int], bool] | None = None,
                 on_freed: Callable[[int], None] | None = None, kind: str = "group") -> None:
        if num_groups < 1:
            raise ValueError(f"need >= 1 group of pages, got {num_groups}")
        self.cache, self.num_groups = cache, num_groups
        self.kind = kind  # what the pages are, in error messages
        self.on_dropped = on_dropped  # told of each block whose idle pages were reclaimed
        self.on_freed = on_freed  # told of each block whose pages went back, for any reason
        self.keep_idle = keep_idle
        self._pages: dict[int, list[int]] = {}
        self._held: Counter[int] = Counter()
        self._idle: OrderedDict[int, int] = OrderedDict()  # block -> idle since; oldest first
        cache.reclaimer = self
        cache.pool.on_free = self._block_freed

    # ---------------------------------------------------------------- queries
    def pages(self, block_id: int) -> list[int]:
        """``block_id``'s page in every group; KeyError if it has none."""
        return self._pages[block_id]

    def has_pages(self, block_id: int) -> bool:
        return block_id in self._pages

    def is_held(self, block_id: int) -> bool:
        return block_id in self._held

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

    # ---------------------------------------------------------------- changes
    def give(self, block_ids: Sequence[int], pages: Sequence[int], held: bool = True) -> None:
        """Blocks without pages get ``num_groups`` fresh pages each (the caller's blocks
        of the cache), held once, or idle (``held`` False: kept only if ``keep_idle``).
        O(pages)."""
        g = self.num_groups
        if len(pages) != g * len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks need {g * len(block_ids)} pages, "
                             f"got {len(pages)}")
        for i, b in enumerate(block_ids):
            if b in self._pages:
                raise RuntimeError(f"block {b} has {self.kind} pages already; this indicates "
                                   "a bug")
            self._pages[b] = list(pages[i * g:(i + 1) * g])
            self._held[b] = 1
        if not held:
            self.unhold(block_ids)

    def hold(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (which must have pages). O(blocks)."""
        for b in block_ids:
            if b not in self._pages:
                raise RuntimeError(f"block {b} has no {self.kind} pages to hold; this "
                                   "indicates a bug")
            self._held[b] += 1
            self._idle.pop(b, None)

    def unhold(self, block_ids: Iterable[int]) -> None:
        """One holder fewer for each block; unheld, a block turns idle, or gives its pages
        back unless ``keep_idle``. O(blocks)."""
        for b in block_ids:
            if self._held[b] <= 0:
                raise RuntimeError(f"block {b}: {self.kind} pages released more often than "
                                   "held; this indicates a bug")
            self._held[b] -= 1
            if not self._held[b]:
                del self._held[b]
                if self.keep_idle is None or self.keep_idle(b):
                    self._idle[b] = self.cache.tree.use_stamp()
                else:
                    self._free_pages(b)

    def _block_freed(self, block_id: int) -> None:
        """The pool freed ``block_id``: its pages go with it (a page itself has none)."""
        if block_id not in self._pages:
            return
        if block_id in self._held:
            raise RuntimeError(f"block {block_id} was freed while its {self.kind} pages are "
                               "held; this indicates a bug")
        del self._idle[block_id]
        self._free_pages(block_id)

    def discard_idle(self, block_id: int) -> None:
        """Free ``block_id``'s pages if it is idle (``keep_idle`` no longer says to keep
        them). O(num_groups)."""
        if block_id in self._idle:
            del self._idle[block_id]
            self._free_pages(block_id)

    def _free_pages(self, block_id: int) -> None:
        self.cache.free_blocks(self._pages.pop(block_id))
        if self.on_freed is not None:
            self.on_freed(block_id)

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken invariant. O(blocks with pages)."""
        listed = [p for pages in self._pages.values() for p in pages]
        if len(set(listed)) != len(listed):
            raise RuntimeError(f"a {self.kind} page is listed twice")
        if not set(listed) <= self.cache.caller_blocks:
            raise RuntimeError(f"a {self.kind} page is not a caller block of the cache")
        if any(len(p) != self.num_groups for p in self._pages.values()):
            raise RuntimeError(f"a block has the wrong number of {self.kind} pages")
        if not set(self._held) <= self._pages.keys():
            raise RuntimeError("a block without pages is held")
        if any(n <= 0 for n in self._held.values()):
            raise RuntimeError("a hold count is not positive")
        if set(self._idle) != self._pages.keys() - self._held.keys():
            raise RuntimeError("the idle blocks are not those with pages and no hold")
        stamps = list(self._idle.values())
        if stamps != sorted(stamps):
            raise RuntimeError("idle blocks are not ordered by when they turned idle")
        if self.keep_idle is not None and not all(map(self.keep_idle, self._idle)):
            raise RuntimeError(f"an idle block's {self.kind} pages are kept for no reader")
        if any(self.cache.pool.ref_cnt[b] == 0 for b in self._pages):
            raise RuntimeError(f"a free block still has {self.kind} pages")
