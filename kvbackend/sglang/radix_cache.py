"""SGLang's prefix cache (``BasePrefixCache``) backed by kvbackend's token-exact ``RadixTree``.

Ownership. A KV slot belongs to exactly one of the allocator (free), the tree,
or one request (its private tail). The tree works in blocks of ``page_size``
slots (block id = page id) and owns one SGLang reference per page it lists
(``PageRefs``): the page goes back to the allocator when no node lists it.

Accounting (SGLang's leak check: available + evictable + protected + request-owned == total):
    protected = page_size * tree.num_held_blocks   (pages of locked or pinned nodes)
    evictable = page_size * #{pages the tree references} - protected

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

Matching is token-exact (the tree compares token ids, never hashes; any int64 id,
so multimodal placeholders too) and page-aligned: a hit that ends inside a page
is cut back to the page boundary, because SGLang never lets a request write into
a shared page. Namespaces are ``(extra_key, cache_salt)``: requests of different
LoRA adapters or salts never share a node.

Eviction order is SGLang's: a node's priority is the inserting request's (under
``--radix-eviction-policy priority``; 0 otherwise), a finished request's prompt
is kept at its priority + 1 and its output at its priority, and among equals the
least recently used leaf goes first, whole (SGLang frees whole leaves too: fewer,
larger evictions).

Retention: a request whose ``sampling_params.custom_params`` (the OpenAI server's
``custom_params``) holds ``kv_retain_s`` -- seconds, as vLLM's request option --
leaves its context retained when it finishes (``RadixTree.retain``): evicted only
after every ordinary leaf, for that long; at most ``MAX_RETAINED_FRACTION`` of the
pages are retained. A bad value is ignored with a warning (never raised into the
scheduler).

Every call below is O(depth) plus array operations over the tokens or pages it
reads or writes; none walks pages one by one in Python.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Hashable, Sequence
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
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from kvbackend.core import RadixNode, RadixTree, cdiv
from kvbackend.core.prefix_order import shared_prefix_order
from kvbackend.sglang.page_refs import PageRefs, page_slots

logger = logging.getLogger("kvbackend.sglang")

# SGLang eviction policies the tree's (priority, last use) order implements.
SUPPORTED_EVICTION_POLICIES = ("lru", "priority")
PRETTY_PRINT_NODES = 32
RETAIN_OPTION = "kv_retain_s"  # in sampling_params.custom_params
MAX_RETAINED_FRACTION = 0.5  # of the KV pages, as vLLM's max_retained_fraction default


def cache_namespace(extra_key: Optional[str], cache_salt: Optional[str]) -> Hashable:
    """The tree namespace of a request: None when it has neither extra key nor salt."""
    cache_salt = cache_salt or None
    if extra_key is None and cache_salt is None:
        return None
    return (extra_key, cache_salt)


def retain_seconds(req) -> float:
    """The request's ``kv_retain_s`` from ``custom_params`` (0 when absent); 0 with a
    warning for a value that is not a finite number >= 0. O(1)."""
    custom = getattr(req.sampling_params, "custom_params", None)
    value = custom.get(RETAIN_OPTION, 0) if isinstance(custom, dict) else 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value < math.inf:
        logger.warning("kvbackend: request %s: %s must be a finite number of seconds >= 0, "
                       "got %r; not retained", req.rid, RETAIN_OPTION, value)
        return 0.0
    return float(value)


@dataclass(frozen=True, slots=True)
class TreeHandle:
    """What SGLang stores as ``req.last_node``: a tree node (None: the empty prefix) and
    how many of the tokens on its path belong to the match. Valid while locked."""

    node: Optional[RadixNode]
    num_tokens: int


_EMPTY = TreeHandle(None, 0)


class KVBackendRadixCache(BasePrefixCache):
    """A ``BasePrefixCache`` whose tree is kvbackend's ``RadixTree``.

    Supports full-attention models (one KV pool), any page size, the ``lru`` and
    ``priority`` eviction policies, and ``(extra_key, cache_salt)`` namespaces;
    not EAGLE bigram keys, SWA, Mamba, HiCache host tiers or KV cache events (use
    the HiCache L3 backend in ``kvbackend.sglang.hicache_storage`` for persistence).
    """

    def __init__(self, params: CacheInitParams) -> None:
        if params.disable:
            raise ValueError("kvbackend's radix cache is a prefix cache: build SGLang's own "
                             "cache for --disable-radix-cache")
        if params.is_eagle:
            raise ValueError("kvbackend's radix cache does not support EAGLE (bigram keys)")
        if params.enable_kv_cache_events:
            raise ValueError("kvbackend's radix cache does not publish KV cache events "
                             "(--kv-events-config, enable_kv_cache_events): drop the option "
                             "or --radix-cache-backend kvbackend")
        policy = (params.eviction_policy or "lru").lower()
        if policy not in SUPPORTED_EVICTION_POLICIES:
            raise ValueError(f"kvbackend's radix cache supports --radix-eviction-policy "
                             f"{' or '.join(SUPPORTED_EVICTION_POLICIES)}, got {policy!r}")
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.eviction_policy = policy
        self.sliding_window_size = None
        self.device = torch.device(getattr(self.token_to_kv_pool_allocator, "device", "cpu"))
        self._refused_tokens = False
        if params.enable_metrics:
            self.init_metrics_collector()
        self.reset()

    # ----------------------------------------------------------------- set-up
    def reset(self) -> None:
        """Forget everything cached (SGLang clears the allocator itself on a flush).
        O(pages) for the fresh page counts."""
        self.refs = PageRefs(self.token_to_kv_pool_allocator, self.page_size)
        num_pages = self.token_to_kv_pool_allocator.size // self.page_size
        self.tree = RadixTree(self.page_size, self.refs,
                              max_retained_blocks=int(MAX_RETAINED_FRACTION * num_pages))
        self.root_node = _EMPTY

    def _page_aligned(self, ids: Any) -> np.ndarray:
        """SGLang token ids (``array('q')`` taken without a copy, other containers by
        value) cut to whole pages; the tree validates them."""
        tokens = np.asarray(ids)
        return tokens[: len(tokens) // self.page_size * self.page_size]

    def _refuse(self, error: ValueError) -> None:
        """Token ids the tree cannot hold (negative ones): the request is served without
        caching rather than failing the scheduler's step; logged once."""
        if not self._refused_tokens:
            logger.warning("kvbackend radix cache: not caching requests with %s", error)
            self._refused_tokens = True

    # ---------------------------------------------------------------- queries
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached page-aligned prefix of ``params.key``; marks the path as used.

        Complexity: O(depth + matched tokens); splits the node the match ends in, so
        a lock protects the match and nothing past it (SGLang splits on match too).
        """
        key = params.key
        tokens = self._page_aligned(key.raw_token_ids())
        namespace = cache_namespace(key.extra_key, key.cache_salt)
        try:
            num_tokens, node = self.tree.lookup(tokens, namespace)
        except ValueError as e:
            self._refuse(e)
            return self._match_result(_EMPTY)
        num_tokens = num_tokens // self.page_size * self.page_size
        handle = TreeHandle(self.tree.split_at(node, num_tokens), num_tokens) if num_tokens \
            else _EMPTY
        if params.req is not None:
            self.tree.record_query(namespace, len(tokens), num_tokens)
        return self._match_result(handle)

    def touch_prefix(self, key) -> None:
        """Mark the cached prefix of ``key`` as used. O(depth + matched tokens)."""
        try:
            self.tree.lookup(self._page_aligned(key.raw_token_ids()),
                             cache_namespace(key.extra_key, key.cache_salt))
        except ValueError as e:
            self._refuse(e)

    @staticmethod
    def _match_result(handle: TreeHandle) -> MatchResult:
        return MatchResult(device_prefix_len=handle.num_tokens, last_device_node=handle,
                           last_host_node=handle, best_match_node=handle)

    def path_device_indices(self, node: TreeHandle) -> torch.Tensor:
        """KV slot indices of the handle's tokens, int64. O(depth + pages), vectorized."""
        if node.node is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        pages = self.tree.path_block_ids(node.node, node.num_tokens)
        return page_slots(pages, self.page_size).to(self.device)

    def dfs_weight_order(self, node_handles: Sequence[TreeHandle]) -> list[int]:
        """SGLang's ``dfs-weight`` schedule: requests sharing a cached prefix together,
        the most shared first. O(r * depth) for r requests; see ``core/prefix_order.py``."""
        return shared_prefix_order([h.node for h in node_handles], self.tree.roots.values())

    # ----------------------------------------------------------------- update
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """Insert the request's row ``[0, up_to)`` (rounded down to a page) into the tree,
        free the request's pages the tree already had, re-point the row at the tree's
        pages, advance ``cache_protected_len`` and move the request's lock.

        Complexity: O(depth + tokens up to ``up_to``) in array operations.
        """
        ps = self.page_size
        kv = req.kv
        protected = kv.cache_protected_len
        key_len = up_to // ps * ps
        if key_len <= protected:
            self._retain_if_finished(req)
            return
        tokens = np.asarray(req.full_untruncated_fill_ids)[:key_len]
        namespace = cache_namespace(req.extra_key, req.cache_salt)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        own_pages = row[:key_len:ps].cpu().numpy().astype(np.int64) // ps
        priority = (req.priority or 0) if self.eviction_policy == "priority" else 0
        locked = req.last_node.node if isinstance(req.last_node, TreeHandle) else None
        try:
            node = self.tree.insert(tokens, own_pages, namespace, priority=priority,
                                    caller_lock=locked).node
        except ValueError as e:
            self._refuse(e)
            return  # the request keeps its pages; release_kv_cache frees them
        if self.eviction_policy == "priority":
            self._keep_prompt_above_output(req, node, priority)

        # [protected, key_len): pages the tree kept from before are duplicates of ours.
        tree_pages = self.tree.path_block_ids(node, key_len)[protected // ps:]
        own_new = own_pages[protected // ps:]
        duplicates = own_new[tree_pages != own_new]
        if len(duplicates):
            self.token_to_kv_pool_allocator.free_page_ids(
                torch.from_numpy(duplicates).to(self.device))
        self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, key_len)),
                                     page_slots(tree_pages, ps).to(row.dtype).to(row.device))
        kv.cache_protected_len = key_len
        kv.cache_inserted_len = max(kv.cache_inserted_len, key_len)
        handle = TreeHandle(node, key_len)  # insert's node ends at key_len, splits keep it so
        new_lock = self.lock(handle)
        self.unlock(req.lock)
        req.lock = new_lock
        req.last_node = handle
        self._retain_if_finished(req)

    def _retain_if_finished(self, req) -> None:
        """At the finishing checkpoint, retain the request's cached context for its
        ``kv_retain_s``. O(depth + log n); see ``RadixTree.retain``."""
        node = req.last_node.node if isinstance(req.last_node, TreeHandle) else None
        if node is None or not req.finished():
            return
        seconds = retain_seconds(req)
        if seconds:
            self.tree.retain(self.tree.split_at(node, req.last_node.num_tokens), seconds)

    def _keep_prompt_above_output(self, req, node: RadixNode, priority: int) -> None:
        """SGLang's rule: a request's prompt is cached at its priority + 1, so outputs of
        equal priority are evicted before prompts: split ``node`` (the inserted path's end)
        at the page-aligned prompt's end and raise the prompt's path. O(depth + tokens of
        the split node)."""
        prompt_len = len(req.origin_input_ids) // self.page_size * self.page_size
        if 0 < prompt_len < node.end:
            self.tree.raise_priority(self.tree.split_at(node, prompt_len), priority + 1)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` tokens by dropping whole unlocked leaves.

        Complexity: O(l log n + k) for l leaves, k pages freed, n evictable leaves.
        """
        if params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_pages = cdiv(params.num_tokens, self.page_size)
        evicted = self.tree.evict(num_pages, whole_leaves=True) * self.page_size
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def inc_lock_ref(self, node: TreeHandle) -> IncLockRefResult:
        """O(depth)."""
        if node.node is None:
            return IncLockRefResult(delta=0)
        before = self.evictable_size()
        self.tree.lock(node.node)
        return IncLockRefResult(delta=self.evictable_size() - before)

    def dec_lock_ref(self, node: TreeHandle,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        """O(depth)."""
        if node.node is None:
            return DecLockRefResult(delta=0)
        before = self.evictable_size()
        self.tree.unlock(node.node)
        return DecLockRefResult(delta=self.evictable_size() - before)

    # ------------------------------------------------------------------ pins
    def pin_prefix(self, token_ids: Sequence[int], *, extra_key: Optional[str] = None,
                   cache_salt: Optional[str] = None) -> bool:
        """Keep a cached prefix resident until as many ``unpin_prefix`` calls; False unless
        all of it (page-aligned) is cached. The pinned tokens count as protected.
        O(depth + tokens)."""
        return self.tree.pin(self._page_aligned(token_ids), cache_namespace(extra_key, cache_salt))

    def unpin_prefix(self, token_ids: Sequence[int], *, extra_key: Optional[str] = None,
                     cache_salt: Optional[str] = None) -> None:
        """Undo one ``pin_prefix``; ValueError if the prefix is not pinned. O(depth + tokens)."""
        self.tree.unpin(self._page_aligned(token_ids), cache_namespace(extra_key, cache_salt))

    # ------------------------------------------------------------ accounting
    def supports_prefix_sharing(self) -> bool:
        return True

    def evictable_size(self) -> int:
        """Slots of pages the tree lists and no lock or pin protects. O(1)."""
        return (self.refs.num_pages - self.tree.num_held_blocks) * self.page_size

    def protected_size(self) -> int:
        """Slots of pages that locked or pinned nodes list. O(1)."""
        return self.tree.num_held_blocks * self.page_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        """Slots the tree owns (shared pages counted once). O(1)."""
        return self.refs.num_pages * self.page_size

    def pretty_print(self) -> None:
        """The tree's sizes and its oldest ``PRETTY_PRINT_NODES`` nodes: a few lines however
        big the tree (SGLang prints it on out-of-memory paths). O(nodes)."""
        nodes = list(self.tree.iter_nodes(all_namespaces=True))
        print(f"kvbackend radix tree: {len(nodes)} nodes, {self.total_size()} tokens "
              f"({self.protected_size()} protected, {self.evictable_size()} evictable)")
        for node in heapq.nsmallest(PRETTY_PRINT_NODES, nodes, key=lambda n: n.node_id):
            print(f"  {node!r} priority={node.priority}"[:200])
        if len(nodes) > PRETTY_PRINT_NODES:
            print(f"  ... {len(nodes) - PRETTY_PRINT_NODES} more nodes")
        print(f"#tokens: {self.total_size()}")

    def check_invariants(self) -> None:
        """The tree's invariants, plus: the page counts are the tree's listings.
        O(nodes + pages)."""
        self.tree.check_invariants()
        nodes = self.tree.iter_nodes(all_namespaces=True)
        self.refs.check_invariants([node.block_ids for node in nodes])


__all__ = ["KVBackendRadixCache", "TreeHandle", "cache_namespace", "SUPPORTED_EVICTION_POLICIES"]
