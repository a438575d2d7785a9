"""The radix tree's references to SGLang KV pages, and page -> slot expansion.

SGLang has no per-slot refcount: a KV slot belongs to exactly one of the allocator
(free), the tree, or one request. The tree works in blocks of ``page_size`` slots
(block id = page id = ``slot // page_size``) and may list one page in two nodes (a
node that starts inside a page shares it with its parent), so ``PageRefs`` counts
the tree's references per page and owns exactly one SGLang reference for each
page it counts. The loops over pages are compiled (numba): a node of a 128k-token
prompt at page size 1 lists 128k pages.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch


@numba.njit(cache=True, nogil=True)
def _ref(counts, ids):  # pragma: no cover - compiled
    """counts[ids] += 1; returns how many were 0 before, or -1 (nothing changed) for an
    id out of range."""
    for p in ids:
        if p < 0 or p >= len(counts):
            return -1
    new = 0
    for p in ids:
        new += counts[p] == 0
        counts[p] += 1
    return new


@numba.njit(cache=True, nogil=True)
def _unref(counts, ids):  # pragma: no cover - compiled
    """counts[ids] -= 1; returns the ids that reached 0, or None (nothing changed) when
    an id is out of range or not referenced."""
    for p in ids:
        if p < 0 or p >= len(counts) or counts[p] <= 0:
            return None
    freed = np.empty(len(ids), dtype=ids.dtype)
    n = 0
    for p in ids:
        counts[p] -= 1
        if counts[p] == 0:
            freed[n] = p
            n += 1
    return freed[:n]


@numba.njit(cache=True, nogil=True)
def _page_slots(pages, page_size):  # pragma: no cover - compiled
    slots = np.empty(len(pages) * page_size, dtype=pages.dtype)
    for i in range(len(pages)):
        base = pages[i] * page_size
        for j in range(page_size):
            slots[i * page_size + j] = base + j
    return slots


def page_slots(pages: np.ndarray, page_size: int) -> torch.Tensor:
    """The slots of whole pages (int64), in order. O(slots), one pass, no temporaries."""
    pages = pages.astype(np.int64, copy=False)
    return torch.from_numpy(pages if page_size == 1 else _page_slots(pages, page_size))


class PageRefs:
    """The ``BlockRefs`` the tree calls: one reference count per page id, in an array.

    The tree owns SGLang's single reference to a page while its count is positive:
    the first reference adopts the page from the request that computed it, the last
    hands it back to the allocator. Holds need nothing per page: the tree counts its
    held pages itself (``RadixTree.num_held_blocks``) and never drops a locked node's.

    Invariants (``check_invariants``): counts[p] == #(tree nodes listing page p);
    num_pages == #{p : counts[p] > 0}.
    """

    def __init__(self, allocator: Any, page_size: int) -> None:
        self.allocator = allocator
        self.counts = np.zeros(allocator.size // page_size + 2, dtype=np.int32)
        self.num_pages = 0

    def ref(self, ids: np.ndarray, *, hold: bool) -> None:
        """Take one reference to each of ``ids`` (distinct page ids). O(len(ids))."""
        new = _ref(self.counts, ids)
        if new < 0:
            raise RuntimeError(f"page ids {ids[:8].tolist()}... outside the KV pool "
                               f"(pages 0..{len(self.counts) - 1}) indicate a bug")
        self.num_pages += new

    def unref(self, ids: np.ndarray, *, hold: bool) -> int:
        """Drop one reference to each of ``ids``; pages left without one go back to the
        allocator. Returns how many did. O(len(ids))."""
        freed = _unref(self.counts, ids)
        if freed is None:
            raise RuntimeError(f"unref of pages {ids[:8].tolist()}... the tree does not hold "
                               "indicates a bug")
        if len(freed):
            self.num_pages -= len(freed)
            self.allocator.free_page_ids(torch.from_numpy(freed).to(self.allocator.device))
        return len(freed)

    def hold(self, ids: np.ndarray) -> None:
        """Nothing to do per page (see the class docstring)."""

    def unhold(self, ids: np.ndarray) -> None:
        """Nothing to do per page (see the class docstring)."""

    def check_invariants(self, listings: list[np.ndarray]) -> None:
        """Raise ``RuntimeError`` naming a broken invariant, given every tree node's page
        list. O(nodes + pages)."""
        listed = np.zeros_like(self.counts)
        for pages in listings:
            listed[pages] += 1  # a node lists distinct pages
        if not np.array_equal(listed, self.counts):
            raise RuntimeError(f"page counts differ from the tree's at pages "
                               f"{np.flatnonzero(listed != self.counts)[:8].tolist()}")
        if self.num_pages != np.count_nonzero(listed):
            raise RuntimeError(f"num_pages {self.num_pages} != "
                               f"{np.count_nonzero(listed)} pages listed")
