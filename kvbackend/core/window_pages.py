"""Sliding-window pages: a block's KV in sliding-window layers, kept while a window
reaches it.

From position p a sliding-window layer attends to positions (p - window, p] only.
A block's pages in the sliding-window groups (``GroupPages``) are held while a live
sequence's window reaches it, then idle until the pool needs them.

A hit of ``h`` tokens reads the pages of the blocks holding positions
[h - window + 1, h) (from ``window_start(h)`` on): ``longest_hit`` cuts a match
back to the longest prefix whose window blocks all have their pages.

Invariants: ``GroupPages``'s (``check_invariants``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbackend.core.group_pages import GroupPages
from kvbackend.core.prefix_cache import PrefixCache
from kvbackend.core.token_ops import cdiv


class WindowPages(GroupPages):
    """Each logical block's pages in the sliding-window groups, with their holds.
    ``longest_hit`` O(blocks of the match); the rest as ``GroupPages``."""

    def __init__(self, cache: PrefixCache, num_groups: int, window: int,
                 on_dropped: Callable[[int], None] | None = None) -> None:
        if window < 1:
            raise ValueError(f"a sliding window spans >= 1 token, got {window}")
        super().__init__(cache, num_groups, on_dropped, kind="sliding-window")
        self.window, self.block_size = window, cache.block_size

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
                       if not self.has_pages(block_ids[i])]
            if not missing:
                return h
            h = missing[-1] * self.block_size
        return 0
