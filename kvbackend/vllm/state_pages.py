"""A Mamba / linear-attention hybrid's state pages, kept only where a reader needs them.

In vLLM's "align" mode the workers read a request's state group at two block
indices only (``preprocess_mamba``, ``mamba_get_block_table_tensor``): the block of
the previous step's last token (copied from, before the forward pass) and the block
of this step's last token (updated). vLLM's ``MambaManager`` lists its null block
everywhere else. kvbackend does the same (``PagedBlockGroups``): a logical block's
state pages (one per state group, further blocks of the pool: ``GroupPages``) exist

- while a request holds them (``_held``): the block its previous step ended in and
  the one its current step ends in (at admission: the hit's last block, whose
  checkpoint the first step resumes from, and a tier load's last block, which the
  load fills with its checkpoint); a request lets go of the others when it is
  scheduled again. Pages let go of are written only by later steps, which run after
  every step that read them (one stream, steps in order), as with vLLM's frees;
- while the block holds a state checkpoint (``StateCheckpoints``) that the tree
  may hit: idle, until the pool needs them (``GroupPages.keep_idle``).

A block whose pages go back for any reason stops being a checkpoint, and a pending
checkpoint copy into or out of it is dropped (``StateCheckpoints.drop``; a copy's
destination it would have filled is no checkpoint either, and gives its idle pages
back). So every recorded checkpoint of a block in the pool has its pages.

Invariants (``check_invariants``): ``GroupPages``'s; every block a request holds
has pages and is held; every recorded checkpoint has pages or is free in the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbackend.core.group_pages import GroupPages
from kvbackend.core.prefix_cache import PrefixCache
from kvbackend.vllm.state_checkpoints import StateCheckpoints


class StatePages:
    """The state groups' pages of a hybrid's blocks, and which requests hold which.
    O(blocks given) per call."""

    def __init__(self, cache: PrefixCache, num_groups: int, checkpoints: StateCheckpoints,
                 on_removed: Callable[[int], None] | None = None) -> None:
        self.cache, self.checkpoints = cache, checkpoints
        self.on_removed = on_removed  # told of each block that stopped holding a state
        self.pages = GroupPages(cache, num_groups, keep_idle=checkpoints.holds,
                                on_freed=self._freed, kind="state")
        self._held: dict[str, list[int]] = {}  # request -> blocks it holds, oldest first

    def hold(self, request_id: str, block_ids: Sequence[int]) -> None:
        """``request_id`` holds blocks that have pages (a hit's last block)."""
        self.pages.hold(block_ids)
        self._held.setdefault(request_id, []).extend(block_ids)

    def give(self, request_id: str, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """New blocks of ``request_id`` get ``pages`` (the caller's blocks of the cache),
        held by it."""
        self.pages.give(block_ids, pages)
        self._held.setdefault(request_id, []).extend(block_ids)

    def advance(self, request_id: str, current: int, pages: Sequence[int] = ()) -> None:
        """``request_id`` is scheduled for a step ending in block ``current``: a new block
        of its table that gets ``pages``, or the block its previous step ended in. It
        keeps ``current`` and that block (the workers' copy source), and lets go of the
        others. O(blocks let go)."""
        held = self._held[request_id]
        previous = held[-1]  # its previous step's (at admission: its hit's or its load's)
        if pages:
            self.pages.give([current], pages)
        elif current != previous:
            raise RuntimeError(f"request {request_id}'s step ends in block {current}, which "
                               "has no state pages; this indicates a bug")
        keep = [previous, current] if current != previous else [current]
        self.pages.unhold([b for b in held if b not in keep])
        self._held[request_id] = keep

    def release(self, request_id: str) -> None:
        """``request_id`` ended (finished, aborted, preempted): it holds nothing."""
        self.pages.unhold(self._held.pop(request_id, ()))

    def copy_into(self, src: int, dst: int) -> list[int] | None:
        """Record that ``dst`` holds ``src``'s checkpoint once the next step's copies ran,
        giving ``dst`` idle pages if it has none; returns those pages (handed out anew),
        or None (nothing changed) when the pool cannot supply them without evicting
        ``dst`` itself. O(num_groups + evictions)."""
        pages: list[int] = []
        if not self.pages.has_pages(dst):
            pages = self.cache.allocate_blocks(self.pages.num_groups)
            if pages is None:
                return None
            if dst in pages or not self.cache.pool.ref_cnt[dst]:  # evicted to make room
                self.cache.free_blocks(pages)
                return None
        self.checkpoints.copy_to(src, dst)
        if pages:
            self.pages.give([dst], pages, held=False)
        return pages

    def _freed(self, block_id: int) -> None:
        """``block_id``'s pages went back: no state there, nor copied out of it."""
        was_checkpoint = self.checkpoints.holds(block_id)
        lost = self.checkpoints.drop(block_id)
        if was_checkpoint and self.on_removed is not None:
            self.on_removed(block_id)
        for dst in lost:
            if self.on_removed is not None:
                self.on_removed(dst)
            self.pages.discard_idle(dst)

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken invariant. O(blocks with pages)."""
        self.pages.check_invariants()
        listed = {b for blocks in self._held.values() for b in blocks}
        if any(not self.pages.has_pages(b) for b in listed):
            raise RuntimeError("a request holds a block without state pages")
        if any(not self.pages.is_held(b) for b in listed):
            raise RuntimeError("a block a request holds is not held")
        pool = self.cache.pool
        for b in range(1, pool.num_blocks):
            if self.checkpoints.holds(b) and pool.ref_cnt[b] and not self.pages.has_pages(b):
                raise RuntimeError(f"checkpoint block {b} is in the pool without state pages")
