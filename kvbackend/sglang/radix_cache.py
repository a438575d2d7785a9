"""SGLang's prefix cache (``BasePrefixCache``) backed by kvbackend's token-exact ``RadixTree``.

Ownership. SGLang has no per-slot refcount: a KV slot belongs to exactly one of
the allocator (free), the tree, or one request (its private tail). The tree
works in blocks of ``page_size`` slots (block id = page id = ``slot // page_size``)
and may reference one page from two nodes (a node that starts inside a page
shares it with its parent), so ``_PageRefs`` counts the tree's references per
page and owns exactly one SGLang reference for each page it counts: the page
goes back to the allocator when the tree's last reference goes.

Accounting (SGLang's leak check: available + evictable + protected + request-owned == total):
    evictable = page_size * #{pages the tree references, none held}
    protected = page_size * #{pages held by a locked or pinned node}

Request lifecycle, as the scheduler drives it (half-open ranges of one row):

    match_prefix          row [0, prefix_len) will read the tree's pages; prefix_len page-aligned
    lock(last_node)       the matched path cannot be evicted
    checkpoint(up_to)     [0, protected) tree-owned | [protected, key_len) inserted now |
                          the tail private;
                          key_len = up_to rounded down to a page; the request's pages that
                          duplicate the tree's are freed, the row is re-pointed at the tree's
                          pages, protected = key_len, and the lock moves to the new node
    release_kv_cache      checkpoint, free_kv_row [protected, owned), unlock, on_release
    evict_for_alloc(n)    the tree frees >= n tokens from the tails of unlocked leaves,
                          lowest (priority, last use) first

Matching is token-exact (the tree compares token ids, never hashes) and
page-aligned: a hit that ends inside a page is cut back to the page boundary,
because SGLang never lets a request write into a shared page. Namespaces are
``(extra_key, cache_salt)``: requests of different LoRA adapters or salts never
share a node.

Eviction trims leaves from their tails, so a request's output tokens go before
its prompt without SGLang's extra split at the prompt boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
    _dfs_weight_order,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from kvbackend.core import RadixNode, RadixTree

logger = logging.getLogger("kvbackend.sglang")

# SGLang eviction policies the tree's (priority, last use) order implements.
SUPPORTED_EVICTION_POLICIES = ("lru", "priority")


def cache_namespace(extra_key: Optional[str], cache_salt: Optional[str]) -> Hashable:
    """The tree namespace of a request: None when it has neither extra key nor salt."""
    cache_salt = cache_salt or None
    if extra_key is None and cache_salt is None:
        return None
    return (extra_key, cache_salt)


def _tokens(ids: Any) -> np.ndarray:
    """SGLang token ids (``array('q')`` or a list) as an int64 array, without a copy for arrays."""
    try:
        return np.frombuffer(ids, dtype=np.int64) if len(ids) else np.empty(0, np.int64)
    except (TypeError, ValueError):
        return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class TreeHandle:
    """What SGLang stores as ``req.last_node``: a tree node (None: the empty prefix) and
    how many of the tokens on its path belong to the match. Valid while locked."""

    node: Optional[RadixNode]
    num_tokens: int


_EMPTY = TreeHandle(None, 0)


class _PageRefs:
    """The tree's references to SGLang pages (the ``BlockRefs`` the tree calls).

    Invariants: ``0 < hold_cnt[p] <= ref_cnt[p]`` for every held page; a page is in
    ``ref_cnt`` iff the tree holds SGLang's single reference to it.
    """

    def __init__(self, allocator: Any, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.ref_cnt: dict[int, int] = {}
        self.hold_cnt: dict[int, int] = {}

    @property
    def num_pages(self) -> int:
        return len(self.ref_cnt)

    @property
    def num_held_pages(self) -> int:
        return len(self.hold_cnt)

    def ref(self, ids: Sequence[int], *, hold: bool) -> None:
        """A first reference adopts the page from the request that computed it."""
        for p in ids:
            self.ref_cnt[p] = self.ref_cnt.get(p, 0) + 1
        if hold:
            self.hold(ids)

    def unref(self, ids: Sequence[int], *, hold: bool) -> int:
        if hold:
            self.unhold(ids)
        freed = []
        for p in ids:
            count = self.ref_cnt.get(p, 0)
            if count <= 0:
                raise RuntimeError(f"page {p}: unref of a page the tree does not hold "
                                   "indicates a bug")
            if count == 1:
                if p in self.hold_cnt:
                    raise RuntimeError(f"page {p}: last reference dropped while held")
                del self.ref_cnt[p]
                freed.append(p)
            else:
                self.ref_cnt[p] = count - 1
        if freed:
            self.allocator.free_page_ids(
                torch.tensor(freed, dtype=torch.int64, device=self.allocator.device))
        return len(freed)

    def hold(self, ids: Sequence[int]) -> None:
        for p in ids:
            held = self.hold_cnt.get(p, 0)
            if held >= self.ref_cnt.get(p, 0):
                raise RuntimeError(f"page {p}: hold without a reference indicates a bug")
            self.hold_cnt[p] = held + 1

    def unhold(self, ids: Sequence[int]) -> None:
        for p in ids:
            held = self.hold_cnt.get(p, 0)
            if held <= 0:
                raise RuntimeError(f"page {p}: unhold of a page nobody holds indicates a bug")
            if held == 1:
                del self.hold_cnt[p]
            else:
                self.hold_cnt[p] = held - 1


class _Forest:
    """A virtual root above the per-namespace roots (for SGLang's DFS scheduling order)."""

    def __init__(self, roots: Mapping) -> None:
        self.children = roots


class KVBackendRadixCache(BasePrefixCache):
    """A ``BasePrefixCache`` whose tree is kvbackend's ``RadixTree``.

    Supports full-attention models (one KV pool), any page size, the ``lru`` and
    ``priority`` eviction policies, and ``(extra_key, cache_salt)`` namespaces;
    not EAGLE bigram keys, SWA, Mamba or HiCache host tiers (use the HiCache L3
    backend in ``kvbackend.sglang.hicache_storage`` for persistence).
    """

    def __init__(self, params: CacheInitParams) -> None:
        if params.is_eagle:
            raise ValueError("kvbackend's radix cache does not support EAGLE (bigram keys)")
        policy = (params.eviction_policy or "lru").lower()
        if policy not in SUPPORTED_EVICTION_POLICIES:
            raise ValueError(f"kvbackend's radix cache supports --radix-eviction-policy "
                             f"{' or '.join(SUPPORTED_EVICTION_POLICIES)}, got {policy!r}")
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.eviction_policy = policy
        self.sliding_window_size = None
        self.device = torch.device(getattr(self.token_to_kv_pool_allocator, "device", "cpu"))
        if params.enable_metrics:
            self.init_metrics_collector()
        self.reset()

    # ----------------------------------------------------------------- set-up
    def reset(self) -> None:
        """Forget everything cached (SGLang clears the allocator itself on a flush)."""
        self.refs = _PageRefs(self.token_to_kv_pool_allocator, self.page_size)
        self.tree = RadixTree(self.page_size, self.refs)
        self._forest = _Forest(self.tree.roots)
        self.root_node = _EMPTY

    # ---------------------------------------------------------------- queries
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached page-aligned prefix of ``params.key``; marks the path as used.

        Complexity: O(depth + matched tokens); splits the node the match ends in.
        """
        key = params.key
        if self.disable or key.is_bigram:
            return self._match_result(_EMPTY)
        tokens = _tokens(key.raw_token_ids())
        tokens = tokens[: len(tokens) // self.page_size * self.page_size]
        namespace = cache_namespace(key.extra_key, key.cache_salt)
        handle = self._find(tokens, namespace)
        if params.req is not None:
            self.tree.record_query(namespace, len(tokens), handle.num_tokens)
        return self._match_result(handle)

    def touch_prefix(self, key) -> None:
        if not self.disable:
            tokens = _tokens(key.raw_token_ids())
            self.tree.match(tokens, cache_namespace(key.extra_key, key.cache_salt))

    def _find(self, tokens: np.ndarray, namespace: Hashable) -> TreeHandle:
        """Match, cut back to a page boundary, and make a node end exactly there, so a
        lock protects the match and nothing past it (SGLang splits on match too)."""
        found = self.tree.match(tokens, namespace)
        num = found.num_tokens // self.page_size * self.page_size
        if num == 0:
            return _EMPTY
        node = found.node
        while not node.parent.is_root and node.parent.end >= num:
            node = node.parent
        if node.end > num:
            # The core has no public split; re-inserting a cached prefix splits at its end
            # and takes no references (every token is cached already).
            node = self.tree.insert(tokens[:num], found.block_ids[: num // self.page_size],
                                    namespace).node
        return TreeHandle(node, num)

    @staticmethod
    def _match_result(handle: TreeHandle) -> MatchResult:
        return MatchResult(device_prefix_len=handle.num_tokens, last_device_node=handle,
                           last_host_node=handle, best_match_node=handle)

    def path_device_indices(self, node: TreeHandle) -> torch.Tensor:
        """KV slot indices of the handle's tokens, int64. O(depth + tokens)."""
        if node.node is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if node.node.end < node.num_tokens:
            raise RuntimeError(f"{node!r} outlived its tokens (evicted while unlocked?)")
        pages = torch.tensor(self._path_pages(node.node), dtype=torch.int64)
        if self.page_size > 1:
            pages = (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        return pages[: node.num_tokens].to(self.device)

    def _path_pages(self, node: RadixNode) -> list[int]:
        """Page ids of the path from the root to ``node``; where a node starts inside
        a page, its own copy of that page wins over its parent's. O(depth + pages)."""
        chain = []
        while not node.is_root:
            chain.append(node)
            node = node.parent
        pages: list[int] = []
        for n in reversed(chain):
            del pages[n.start // self.page_size:]
            pages.extend(n.block_ids)
        return pages

    def resolve_node_handle(self, node_handle: TreeHandle) -> Any:
        return node_handle.node if node_handle.node is not None else self._forest

    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        return _dfs_weight_order(self._forest, node_handles, self.resolve_node_handle)

    # ----------------------------------------------------------------- update
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """Insert the request's row ``[0, up_to)`` (rounded down to a page) into the tree,
        free the request's pages the tree already had, re-point the row at the tree's
        pages, advance ``cache_protected_len`` and move the request's lock.

        Complexity: O(depth + inserted tokens) plus one row write.
        """
        if self.disable:
            return
        ps = self.page_size
        kv = req.kv
        protected = kv.cache_protected_len
        key_len = up_to // ps * ps
        if key_len <= protected:
            return
        tokens = _tokens(req.full_untruncated_fill_ids)[:key_len]
        namespace = cache_namespace(req.extra_key, req.cache_salt)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        own_slots = row[:key_len].to(torch.int64)
        own_pages = own_slots[::ps] // ps
        priority = (req.priority or 0) if self.eviction_policy == "priority" else 0
        inserted = self.tree.insert(tokens, own_pages.tolist(), namespace, priority=priority)
        handle = self._cover(inserted.node, key_len)
        tree_slots = self.path_device_indices(handle)

        # [protected, key_len): pages the tree kept from before are duplicates of ours.
        first = protected // ps
        dup = tree_slots[first * ps::ps] != own_slots[first * ps::ps]
        if bool(dup.any()):
            self.token_to_kv_pool_allocator.free_page_ids(own_pages[first:][dup.cpu()])
        self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, key_len)),
                                     tree_slots[protected:].to(row.dtype))
        kv.cache_protected_len = key_len
        kv.cache_inserted_len = max(kv.cache_inserted_len, key_len)
        new_lock = self.lock(handle)
        self.unlock(req.lock)
        req.lock = new_lock
        req.last_node = handle

    @staticmethod
    def _cover(node: RadixNode, num_tokens: int) -> TreeHandle:
        while not node.parent.is_root and node.parent.end >= num_tokens:
            node = node.parent
        return TreeHandle(node, num_tokens)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` tokens (whole pages) from unlocked leaves.

        Complexity: O(k log n) for k pages freed, n evictable leaves.
        """
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_pages = -(-params.num_tokens // self.page_size)
        evicted = self.tree.evict(num_pages) * self.page_size
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def inc_lock_ref(self, node: TreeHandle) -> IncLockRefResult:
        if node.node is None or self.disable:
            return IncLockRefResult(delta=0)
        before = self.evictable_size()
        self.tree.lock(node.node)
        return IncLockRefResult(delta=self.evictable_size() - before)

    def dec_lock_ref(self, node: TreeHandle,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if node.node is None or self.disable:
            return DecLockRefResult(delta=0)
        before = self.evictable_size()
        self.tree.unlock(node.node)
        return DecLockRefResult(delta=self.evictable_size() - before)

    # ------------------------------------------------------------------ pins
    def pin_prefix(self, token_ids: Sequence[int], *, extra_key: Optional[str] = None,
                   cache_salt: Optional[str] = None) -> bool:
        """Keep a cached prefix resident until ``unpin_prefix``; False unless all of it is
        cached. The pinned tokens count as protected."""
        tokens = _tokens(token_ids)
        tokens = tokens[: len(tokens) // self.page_size * self.page_size]
        return self.tree.pin(tokens, cache_namespace(extra_key, cache_salt))

    def unpin_prefix(self, token_ids: Sequence[int], *, extra_key: Optional[str] = None,
                     cache_salt: Optional[str] = None) -> None:
        tokens = _tokens(token_ids)
        tokens = tokens[: len(tokens) // self.page_size * self.page_size]
        self.tree.unpin(tokens, cache_namespace(extra_key, cache_salt))

    # ------------------------------------------------------------ accounting
    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def evictable_size(self) -> int:
        return (self.refs.num_pages - self.refs.num_held_pages) * self.page_size

    def protected_size(self) -> int:
        return self.refs.num_held_pages * self.page_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        """Slots the tree owns (shared pages counted once)."""
        return self.refs.num_pages * self.page_size

    def pretty_print(self) -> None:
        for node in sorted(self.tree.iter_nodes(all_namespaces=True), key=lambda n: n.node_id):
            print(f"{node!r} priority={node.priority}")
        print(f"#tokens: {self.total_size()}")

    def check_invariants(self) -> None:
        """The tree's invariants, plus: the page references agree with the tree's nodes.
        O(nodes + pages)."""
        self.tree.check_invariants()
        refs: dict[int, int] = {}
        holds: dict[int, int] = {}
        for node in self.tree.iter_nodes(all_namespaces=True):
            for p in node.block_ids:
                refs[p] = refs.get(p, 0) + 1
                if node.lock_ref > 0:
                    holds[p] = holds.get(p, 0) + 1
        if refs != self.refs.ref_cnt or holds != self.refs.hold_cnt:
            raise RuntimeError(f"page references {self.refs.ref_cnt} / holds {self.refs.hold_cnt}"
                               f" != the tree's {refs} / {holds}")


__all__ = ["KVBackendRadixCache", "TreeHandle", "cache_namespace", "SUPPORTED_EVICTION_POLICIES"]
