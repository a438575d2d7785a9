"""Compressed radix tree over token ids, one root per namespace.

An edge holds a run of tokens and its block ids as int64 arrays; children are
keyed by their first token, so a child lookup is one dict access. Matching is
token-exact: the tree compares token ids, never hashes.

    root(ns) ──[t0 .. t9]── A ──[t10 .. t27]── B      block_size 8:
                             └──[u10 .. u15]── C      A holds blocks 0, 1
                                                      B holds blocks 1', 2, 3
                                                      C holds blocks 1'', ...

A node that starts inside a block (B and C start at position 10, inside block 1)
holds its own copy of that block, or shares its parent's: the copy is valid for
positions [8, 10) too, because it was computed (or copied) by a sequence with the
same tokens there. For the same reason a parent may drop its own copy for a
child's (``_borrow_boundary_block``): when eviction would otherwise free nothing, and
when the pool falls short while a locked path holds copies its continuations
replaced (``drop_redundant_copies``).
Reading a path (``path_block_ids``, ``match``) takes the deeper node's copy.

A node's priority is that of the request that inserted its tokens, raised to the
highest priority of any later insert through it (SGLang's rule); a continuation
inserted with a lower priority than its prefix gets a node of its own.

A *retention* (``retain``) keeps a finished request's context -- the path from a
root to a node -- ahead of ordinary entries until its expiry time on an injected
clock: eviction orders unlocked leaves by (retained, priority, full tail, last
access), so every ordinary leaf goes before any retained one, whatever their
priorities, and among retained leaves the lower priority, then the least recently
used, goes first. Within the same standing a leaf ending inside a block gives that
partial block up before any full block goes (it holds fewer tokens; vLLM likewise
reuses its unhashed blocks first), then ranks by its last use like the others.
Locked and pinned nodes are never evictable, retained or not. An expired retention
leaves its nodes exactly as if it had never been made (their priority and last use
were never changed by it). Expiry is lazy: ``evict``, ``insert`` and ``retain`` first
end every retention whose time is up. The distinct blocks listed by retained nodes
(a prefix several retentions share counts once) never exceed ``max_retained_blocks``:
a new retention first ends those on its own path that expire no later (an agent's
earlier turns), then the oldest ones until it fits; one whose context alone exceeds
the bound is not made. Eviction trims a retention to what stays cached
(a removed end node hands it to its parent; one with nothing left ends).

Invariants (checked by ``check_invariants``):
    * children[t].tokens[0] == t; child.start == parent.end; child.parent is parent
    * every non-root node has >= 1 token and exactly
      (end - 1) // block_size - start // block_size + 1 block ids, both int64
      arrays it owns (not views)
    * priority(parent) >= priority(child) below a root
    * lock_ref(node) >= sum(lock_ref(child)); a root's lock_ref is 0
    * the evictable set holds exactly the non-root leaves with lock_ref == 0,
      each under its current key (retain_count > 0, priority, ends on a block
      boundary, last_access, node_id)
    * retain_count(node) == the live retentions whose end node is the node or below
      it; so retain_count(parent) >= retain_count(child) below a root; every
      retention ends at a non-root node in the tree
    * num_retained_blocks is the number of distinct blocks listed by nodes with
      retain_count > 0, and <= max_retained_blocks
    * a block listed by two nodes is the last block of one and the first of a
      descendant that starts inside it, every node between them lying inside that
      block (a sequence's own copy can follow another's copy of the same block);
      num_held_blocks is the number of distinct blocks listed by locked nodes
    * every pinned node is in the tree, locked at least once per ``pin`` call
      still held, and its path spells the pinned tokens
    * every candidate of ``drop_redundant_copies`` is in the tree
    * all nodes under a root carry that root's namespace
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import numpy as np
from sortedcontainers import SortedList

from kvbackend.core.radix_node import BLOCK_DTYPE, InsertResult, PrefixMatch, RadixNode
from kvbackend.core.retention import Retention, RetentionBook
from kvbackend.core.stats import NamespaceStats
from kvbackend.core.token_ops import (
    TOKEN_DTYPE, as_token_array, cdiv, common_prefix_length, load_compiled_loops,
)


class BlockRefs(Protocol):
    """What the tree needs from whoever owns the blocks (``BlockPool`` or an engine's
    allocator). The tree passes block ids as int64 arrays of distinct ids."""

    def ref(self, ids: np.ndarray, *, hold: bool) -> None: ...
    def unref(self, ids: np.ndarray, *, hold: bool) -> int: ...
    def hold(self, ids: np.ndarray) -> None: ...
    def unhold(self, ids: np.ndarray) -> None: ...


class RadixTree:
    """Token-exact prefix index from token runs to KV block ids.

    Eviction removes blocks from the tails of unlocked leaves, ordinary before
    retained, lowest priority first, then least recently used: a shared prefix
    always outlives its suffixes. ``clock`` (seconds) times retentions;
    ``max_retained_blocks`` (None: unbounded) bounds them.
    """

    def __init__(self, block_size: int, blocks: BlockRefs, *,
                 max_retained_blocks: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._blocks = blocks
        self._roots: dict[Hashable, RadixNode] = {}
        self._evictable = SortedList()  # (*evict_key, node) of unlocked leaves
        self._ids = itertools.count(1)
        self._uses = itertools.count(1)  # last_access stamps
        self._now = clock
        if max_retained_blocks is not None and (
                not isinstance(max_retained_blocks, int) or max_retained_blocks < 0):
            raise ValueError(f"max_retained_blocks must be None or an int >= 0, "
                             f"got {max_retained_blocks!r}")
        self.max_retained_blocks = max_retained_blocks
        self.retentions = RetentionBook()
        self._num_retained_blocks = 0
        self._pins: dict[tuple[Hashable, bytes], RadixNode] = {}  # (ns, token bytes) -> node
        self._pin_counts: Counter[tuple[Hashable, bytes]] = Counter()  # pin calls per key
        self._pinned_ends: Counter[int] = Counter()  # node_id -> pinned prefixes ending there
        self._num_held_blocks = 0
        # node_id -> node that ends inside a block and whose child copied that block
        self._copied_boundaries: dict[int, RadixNode] = {}
        self.stats: dict[Hashable, NamespaceStats] = {}
        load_compiled_loops()

    # ----------------------------------------------------------------- queries
    def match(
        self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None, *, touch: bool = True
    ) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` in ``namespace``, with its block ids.

        Does not change what is cached; with ``touch`` it marks the path as used.
        Complexity: O(depth + matched tokens + matched blocks).
        """
        num_tokens, node = self.lookup(tokens, namespace, touch=touch)
        block_ids = self.path_block_ids(node, num_tokens).tolist()
        return PrefixMatch(num_tokens, tuple(block_ids), node, self.block_size)

    def lookup(
        self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None, *, touch: bool = True
    ) -> tuple[int, RadixNode]:
        """``match`` without the block ids: the length of the longest cached prefix and
        the deepest node holding its last token (a root when nothing matched; a
        detached one for an unknown namespace). Complexity: O(depth + matched tokens).
        """
        tokens = as_token_array(tokens)
        node = self._roots.get(namespace)
        if node is None:
            return 0, _new_root(namespace)
        pos, n = 0, len(tokens)
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            k = common_prefix_length(child.tokens, 0, tokens, pos)
            node, pos = child, pos + k
            if k < len(child.tokens):
                break
        if touch:
            self._touch_path(node)
        return pos, node

    @staticmethod
    def node_holding(node: RadixNode, num_tokens: int) -> RadixNode:
        """The node on ``node``'s path that holds token ``num_tokens - 1`` (its root for 0).

        ``num_tokens`` must not exceed ``node.end``. Complexity: O(depth).
        """
        if not 0 <= num_tokens <= node.end:
            raise ValueError(f"{num_tokens} tokens do not lie on the path of {node!r}")
        while not node.is_root and node.start >= num_tokens:
            node = node.parent
        return node

    def path_block_ids(self, node: RadixNode, num_tokens: int | None = None) -> np.ndarray:
        """Block ids of positions ``[0, num_tokens)`` (default ``node.end``) of ``node``'s
        path, read through the node holding the last of them: where a node starts
        inside a block, its own copy of that block wins over its parent's.

        A new int64 array of ``ceil(num_tokens / block_size)`` ids.
        Complexity: O(depth + blocks), one array copy.
        """
        node = self.node_holding(node, node.end if num_tokens is None else num_tokens)
        bs, parts, below = self.block_size, [], None  # below: first block index of the node below
        while not node.is_root:
            first = node.start // bs
            parts.append(node.block_ids if below is None else node.block_ids[: below - first])
            below, node = first, node.parent
        if not parts:
            return np.empty(0, BLOCK_DTYPE)
        blocks = np.concatenate(parts[::-1])
        return blocks if num_tokens is None else blocks[: cdiv(num_tokens, bs)]

    def is_current(self, match: PrefixMatch) -> bool:
        """Whether ``match`` still describes the tree (no eviction touched it). O(depth)."""
        node = match.node
        if node.is_root:
            return True
        if node.end < match.num_tokens:
            return False
        if match.num_partial_tokens:  # the partial block may have been swapped since
            holder = self.node_holding(node, match.num_tokens)  # node may have split
            index = (match.num_tokens - 1) // self.block_size - holder.start // self.block_size
            if holder.block_ids[index] != match.block_ids[-1]:
                return False
        return self.is_attached(node)

    def is_attached(self, node: RadixNode) -> bool:
        """Whether ``node`` is (still) in the tree. O(depth)."""
        while not node.is_root:
            if node.parent.children.get(int(node.tokens[0])) is not node:
                return False
            node = node.parent
        return self._roots.get(node.namespace) is node

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks listed by locked (or pinned) nodes. O(1), kept up to date."""
        return self._num_held_blocks

    @property
    def num_retained_blocks(self) -> int:
        """Distinct blocks listed by retained nodes (a shared prefix counts once). O(1)."""
        return self._num_retained_blocks

    def pins(self) -> list[tuple[RadixNode, int]]:
        """Every pinned node with the number of ``pin`` calls it holds. O(pinned prefixes)."""
        return [(node, self._pin_counts[key]) for key, node in self._pins.items()]

    def namespaces(self) -> list[Hashable]:
        return list(self._roots)

    @property
    def roots(self) -> Mapping[Hashable, RadixNode]:
        """A live read-only view: namespace -> its root node. O(1)."""
        return MappingProxyType(self._roots)

    def iter_nodes(self, namespace: Hashable = None, *,
                   all_namespaces: bool = False) -> Iterator[RadixNode]:
        """Every non-root node (of one namespace, or of all). O(nodes)."""
        roots = self._roots.values() if all_namespaces else [self._roots.get(namespace)]
        stack = [r for r in roots if r is not None]
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    # --------------------------------------------------------------- mutation
    def insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int] | np.ndarray,
        namespace: Hashable = None,
        *,
        priority: int = 0,
        caller_lock: RadixNode | None = None,
    ) -> InsertResult:
        """Cache ``tokens`` whose KV lives in ``block_ids`` (block i: positions [i*bs, (i+1)*bs)).

        Tokens already cached keep their blocks; the tree takes one reference to each
        block it adopts. The cached path's priority is raised to at least ``priority``
        (higher survives longer); new tokens get exactly ``priority``. ``caller_lock``:
        the node the caller holds its lock on, if any (a leaf grows in place only when
        no one else locks it: another's lock would grow with it).
        Complexity: O(depth + len(tokens) + new blocks).
        """
        tokens = as_token_array(tokens)
        n, bs = len(tokens), self.block_size
        if len(block_ids) < cdiv(n, bs):
            raise ValueError(f"{n} tokens need {cdiv(n, bs)} blocks of {bs}, got {len(block_ids)}")
        self._expire()
        node = self._root(namespace)
        pos = 0
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            k = common_prefix_length(child.tokens, 0, tokens, pos)
            if k < len(child.tokens):
                child = self._split(child, k)
            node, pos = child, pos + k
        existing = pos
        self.raise_priority(node, priority)
        if pos < n:
            node = self._extend(node, tokens[pos:], block_ids, priority, caller_lock)
        self.stats.setdefault(namespace, NamespaceStats()).inserted_tokens += n - existing
        self._touch_path(node)
        return InsertResult(existing, node)

    def split_at(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """Make a node of ``node``'s path end exactly at ``num_tokens`` (splitting the
        one that holds token ``num_tokens - 1``) and return it; caches nothing new.
        Complexity: O(depth + tokens of the split node).
        """
        if num_tokens < 1:
            raise ValueError(f"cannot split a path at {num_tokens} tokens")
        node = self.node_holding(node, num_tokens)
        if node.end > num_tokens:
            node = self._split(node, num_tokens - node.start)
        return node

    def raise_priority(self, node: RadixNode, priority: int) -> None:
        """Raise the priority of ``node``'s path to at least ``priority``. O(depth + log n)
        per raised node (only those below ``priority`` are touched)."""
        while not node.is_root and node.priority < priority:
            node.priority = priority
            self._refresh(node)
            node = node.parent

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction. O(depth + newly held blocks)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self._blocks.hold(node.block_ids)
                self._num_held_blocks += self._path_share(node)
            node.lock_ref += 1
            self._refresh(node)
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``. O(depth + released blocks)."""
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r} indicates a bug")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._blocks.unhold(node.block_ids)
                self._num_held_blocks -= self._path_share(node)
            self._refresh(node)
            node = node.parent

    def pin(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None) -> bool:
        """Keep the cached prefix ``tokens`` resident until as many ``unpin`` calls as
        ``pin`` calls. Returns False (and pins nothing) unless all of ``tokens`` are cached.
        Complexity: O(depth + len(tokens)).
        """
        tokens = as_token_array(tokens)
        key = (namespace, tokens.tobytes())
        node = self._pins.get(key)
        if node is None:
            num_tokens, node = self.lookup(tokens, namespace)
            if num_tokens != len(tokens) or not len(tokens):
                return False
            node = self.split_at(node, num_tokens)  # keeps its identity through later splits
            self._pins[key] = node
            self._pinned_ends[node.node_id] += 1
        self.lock(node)
        self._pin_counts[key] += 1
        return True

    def unpin(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None) -> None:
        """Undo one ``pin``; raises ValueError if ``tokens`` are not pinned. O(depth + len)."""
        key = (namespace, as_token_array(tokens).tobytes())
        node = self._pins.get(key)
        if node is None:
            raise ValueError(f"unpin of a prefix that is not pinned "
                             f"({len(key[1]) // np.dtype(TOKEN_DTYPE).itemsize} tokens, "
                             f"namespace {namespace!r})")
        self.unlock(node)
        self._pin_counts[key] -= 1
        if not self._pin_counts[key]:
            del self._pins[key], self._pin_counts[key]
            self._pinned_ends[node.node_id] -= 1
            if not self._pinned_ends[node.node_id]:
                del self._pinned_ends[node.node_id]

    def unpin_all(self) -> None:
        """Drop every pin. O(pins * depth)."""
        for key, node in self._pins.items():
            for _ in range(self._pin_counts[key]):
                self.unlock(node)
        self._pins.clear()
        self._pin_counts.clear()
        self._pinned_ends.clear()

    def retain(self, node: RadixNode, seconds: float) -> bool:
        """Keep the path to ``node`` (the context, ending exactly at ``node.end``) ahead
        of ordinary entries for ``seconds`` from now (module docstring).

        Returns False, retaining nothing, for 0 seconds, a root, or a context whose
        distinct blocks alone exceed ``max_retained_blocks``. Ends the retentions on the
        path that expire no later, then the oldest ones while the distinct retained
        blocks exceed the bound (a block already retained costs nothing more).
        Complexity: O(depth + log n) plus O(depth + log n) per retention ended.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not 0 <= seconds < math.inf:
            raise ValueError(f"retention seconds must be a finite number >= 0, got {seconds!r}")
        if not seconds or node.is_root or not self._fits_retained(node):
            return False
        now = self._now()
        self._expire(now)
        until = now + seconds
        walk = node
        while not walk.is_root:
            for older in self.retentions.ending_at(walk):
                if older.until <= until:
                    self._end_retention(older)
            walk = walk.parent
        self.retentions.add(node, until)
        self._count_retention(node, +1)
        while not self._fits_retained():  # never the new one: it fits alone
            self._end_retention(self.retentions.oldest())
        return True

    def drop_retentions(self) -> None:
        """End every retention. O(retentions * (depth + log n))."""
        for retention in self.retentions:
            self._end_retention(retention)

    def evict(self, num_blocks: int, *, whole_leaves: bool = False) -> int:
        """Free at least ``num_blocks`` blocks if possible; returns how many were freed.

        Ends the expired retentions, then takes blocks from the tail of the lowest
        (retained, priority, full tail, last use) unlocked leaf, repeatedly (only its
        partial tail block from a leaf ending inside a block); with ``whole_leaves``
        each leaf it takes goes entirely (SGLang's granularity: fewer, larger
        evictions). Complexity: O(l log n + k) for l leaves touched, k blocks
        dropped, n evictable leaves (plus the expiries, see ``retain``).
        """
        self._expire()
        freed, skipped = 0, set()  # leaves that free nothing (ids): few, all of them locked
        while freed < num_blocks:  # parents' children (so not evicted, and kept in order)
            leaf = next((entry[-1] for entry in self._evictable
                         if entry[-1].node_id not in skipped), None)
            if leaf is None:
                break
            if self._frees_nothing(leaf):
                skipped.add(leaf.node_id)
                continue
            stats = self.stats.setdefault(leaf.namespace, NamespaceStats())
            want = 1 if leaf.end % self.block_size else num_blocks - freed  # partial tail
            keep = 0 if whole_leaves else max(len(leaf.block_ids) - want, 0)
            new_end = (leaf.start // self.block_size + keep) * self.block_size
            if new_end <= leaf.start:
                parent = leaf.parent
                dropped = self._blocks.unref(leaf.block_ids, hold=False)
                self._remove_leaf(leaf)
                dropped += self._borrow_boundary_block(parent)
            else:
                dropped = self._blocks.unref(leaf.block_ids[keep:], hold=False)
                if leaf.retain_count:  # it keeps its first block: its share shrinks
                    self._num_retained_blocks -= len(leaf.block_ids) - keep
                leaf.tokens = leaf.tokens[: new_end - leaf.start].copy()
                leaf.block_ids = leaf.block_ids[:keep].copy()
                self._refresh(leaf)  # its tail is full now
            stats.evicted_blocks += dropped
            freed += dropped
        return freed

    def replace_blocks(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
                       block_ids: Sequence[int],
                       replace: Callable[[int, int], bool]) -> list[tuple[int, int]]:
        """Along the cached path of ``tokens``, where a node lists for block ``i`` another
        block than ``block_ids[i]`` (which must be referenced and hold the same tokens'
        KV up to the end of ``tokens``) and ``replace(listed, own)`` says so, the node
        lists ``block_ids[i]`` instead: a block inside one node's token run, or one that
        several nodes of the path list (one ending inside it and the descendants starting
        in it), as long as ``tokens`` cover every such node's tokens in it and no node off
        the path lists it (so it leaves the tree). A block stays where the swap would take
        the retained blocks over their bound. Returns the (old, new) pairs, one per node
        changed. O(depth + blocks of the path + nodes starting inside the blocks changed)."""
        num_tokens, node = self.lookup(tokens, namespace, touch=False)
        bs, listings = self.block_size, {}  # block index -> [(node, position in its list)]
        while not node.is_root:
            for k in range(len(node.block_ids)):
                listings.setdefault(node.start // bs + k, []).append((node, k))
            node = node.parent
        swapped = []
        for i, listed in listings.items():
            if min(listed[0][0].end, (i + 1) * bs) > num_tokens:  # the deepest one
                continue  # ``tokens`` end before some listing node's tokens in block i
            swapped += self._replace_block(listed[::-1], i, int(block_ids[i]), replace)
        return swapped

    def _replace_block(self, listed: list[tuple[RadixNode, int]], index: int, new: int,
                       replace: Callable[[int, int], bool]) -> list[tuple[int, int]]:
        """``replace_blocks`` for block ``index``, listed by the path's ``listed`` (node,
        position) pairs, top node first. Keeps ``num_held_blocks`` and
        ``num_retained_blocks`` exact: every node whose share of them may change (those
        listing the block, and those starting inside it below them) is counted before and
        after. O(nodes starting inside the block)."""
        changes = [(node, k, int(node.block_ids[k])) for node, k in listed
                   if int(node.block_ids[k]) != new and replace(int(node.block_ids[k]), new)]
        if not changes:
            return []
        top = listed[0][0]
        touched = [top, *self._starting_inside(top, index)]
        listings = Counter(int(node.block_ids[index - node.start // self.block_size])
                           for node in touched)
        moved = Counter(old for _, _, old in changes)  # only a block no other node lists
        changes = [change for change in changes if moved[change[2]] == listings[change[2]]]
        if not changes:
            return []
        retained_before = sum(map(self._retained_share, touched))
        held_before = sum(map(self._held_share, touched))
        for node, k, old in changes:
            self._blocks.ref(np.array([new], dtype=np.int64), hold=node.lock_ref > 0)
            node.block_ids[k] = new
        retained = sum(map(self._retained_share, touched)) - retained_before
        self._num_retained_blocks += retained
        if not self._fits_retained():
            self._num_retained_blocks -= retained
            for node, k, old in changes:
                node.block_ids[k] = old
                self._blocks.unref(np.array([new], dtype=np.int64), hold=node.lock_ref > 0)
            return []
        self._num_held_blocks += sum(map(self._held_share, touched)) - held_before
        for node, k, old in changes:
            self._blocks.unref(np.array([old], dtype=np.int64), hold=node.lock_ref > 0)
        return [(old, new) for _, _, old in changes]

    def _starting_inside(self, top: RadixNode, index: int) -> list[RadixNode]:
        """The nodes below ``top`` that start inside block ``index`` (after its first
        token). O(those nodes and their children)."""
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        found, stack = [], list(top.children.values()) if top.end < hi else []
        while stack:
            child = stack.pop()
            if lo < child.start < hi:
                found.append(child)
                stack.extend(child.children.values())
        return found

    def use_stamp(self) -> int:
        """A fresh stamp of the clock that orders the leaves' last uses. O(1)."""
        return next(self._uses)

    def first_victim_key(self) -> tuple[int, int, int, int] | None:
        """(retained, priority, full tail, last use) of the leaf ``evict`` takes blocks
        from first, or None when no leaf frees anything. O(1) plus the leaves skipped."""
        for entry in self._evictable:
            if not self._frees_nothing(entry[-1]):
                return entry[:4]
        return None

    def record_query(self, namespace: Hashable, num_query_tokens: int, num_hit_tokens: int) -> None:
        stats = self.stats.setdefault(namespace, NamespaceStats())
        stats.queries += 1
        stats.query_tokens += num_query_tokens
        stats.hit_tokens += num_hit_tokens

    # ---------------------------------------------------------------- helpers
    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _new_root(namespace)
        return root

    def _extend(self, node: RadixNode, tail: np.ndarray, block_ids: Sequence[int] | np.ndarray,
                priority: int, caller_lock: RadixNode | None) -> RadixNode:
        """Add ``tail`` after ``node``: grow ``node`` in place when it is a leaf of the
        same priority whose last block is the caller's own and that no one but the caller
        locks, else hang a new leaf under it."""
        bs, pos = self.block_size, node.end
        end = pos + len(tail)
        first_new = cdiv(pos, bs)  # first block index that starts at or after pos
        boundary_is_own = pos % bs == 0 or (
            len(node.block_ids) and node.block_ids[-1] == block_ids[pos // bs])
        if (not node.is_root and not node.children and boundary_is_own and not node.retain_count
                and node.priority == priority and not self._is_pinned_end(node)
                and node.lock_ref <= (node is caller_lock)):
            new_blocks = _block_array(block_ids[first_new : cdiv(end, bs)])
            self._blocks.ref(new_blocks, hold=node.lock_ref > 0)
            if node.lock_ref:
                self._num_held_blocks += len(new_blocks)
            node.tokens = np.concatenate([node.tokens, tail])
            node.block_ids = np.concatenate([node.block_ids, new_blocks])
            return node
        leaf_blocks = _block_array(block_ids[pos // bs : cdiv(end, bs)])
        self._blocks.ref(leaf_blocks, hold=False)
        leaf = RadixNode(node.namespace, node, tail.copy(), pos, leaf_blocks, next(self._ids))
        leaf.priority = priority
        node.children[int(tail[0])] = leaf
        if not boundary_is_own:  # the leaf's first block is its own copy of node's last
            self._copied_boundaries[node.node_id] = node
        self._refresh(node)
        self._refresh(leaf)
        return leaf

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` tokens; returns the new upper node."""
        bs = self.block_size
        cut = node.start + k
        first = node.start // bs
        upper_blocks = node.block_ids[: (cut - 1) // bs - first + 1].copy()
        lower_blocks = node.block_ids[cut // bs - first :].copy()
        if cut % bs:  # the block around the cut now belongs to both halves
            self._blocks.ref(lower_blocks[:1], hold=node.lock_ref > 0)
        upper = RadixNode(node.namespace, node.parent, node.tokens[:k].copy(), node.start,
                          upper_blocks, next(self._ids))
        upper.lock_ref, upper.priority = node.lock_ref, node.priority
        upper.retain_count = node.retain_count
        upper.last_access = node.last_access
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens = node.tokens[k:].copy()
        node.start, node.block_ids, node.parent = cut, lower_blocks, upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _remove_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        self._copied_boundaries.pop(leaf.node_id, None)
        self._num_retained_blocks -= self._retained_share(leaf)
        self._discard(leaf)
        for retention in self.retentions.move_end(leaf, parent):
            if parent.is_root:  # nothing of its context is left
                self._end_retention(retention)
        del parent.children[int(leaf.tokens[0])]
        if parent.is_root:
            if not parent.children:
                del self._roots[parent.namespace]
        else:
            self._refresh(parent)

    def _borrow_boundary_block(self, node: RadixNode) -> int:
        """Free the block ``node`` ends inside of when a child holds a copy of it.

        Each child of a node that ends inside a block starts in that block, and its
        first block is valid for the node's positions there too (module docstring).
        So a node with a child that copied its last block may use that copy instead and
        drop its own: after a leaf that shared the node's block is evicted, this is what
        actually frees a block. A node locked on a path (``drop_redundant_copies``) may
        do the same: its hold moves with the block, and the sequences locking it list
        their own blocks. A single child sharing the node's block keeps it as its own
        copy, which then is no longer held through the node (evictable once unlocked);
        with two sharing it the node keeps its block. (A descendant that starts inside
        the block below a copying child may list it too: it counts as sharing.) Nor does
        it swap where the retained blocks would exceed their bound (a retained sharer
        keeps the node's block as well as the node taking the copy), nor where a locked
        node would hold an unlocked donor's copy without freeing its own (a sharer or a
        sequence still holds it): that frees nothing and takes an evictable block.
        Returns the blocks freed. O(nodes inside the block).
        """
        if node.is_root or not node.children or node.end % self.block_size == 0:
            return 0
        own = node.block_ids[-1:].copy()
        sharing = [n for n in self._starting_inside(node, node.end // self.block_size)
                   if n.block_ids[0] == own[0]]  # nodes below it listing its block
        copying = [child for child in node.children.values() if child.block_ids[0] != own[0]]
        if not copying or len(sharing) > 1:
            return 0
        donor = max(copying, key=lambda child: child.lock_ref > 0)  # a held block if any
        touched, held = [node, donor, *sharing], node.lock_ref > 0
        retained_before = sum(map(self._retained_share, touched))
        held_before = sum(map(self._held_share, touched))
        self._blocks.ref(donor.block_ids[:1], hold=held)
        node.block_ids[-1] = donor.block_ids[0]
        retained = sum(map(self._retained_share, touched)) - retained_before
        self._num_retained_blocks += retained
        if not self._fits_retained():  # a retained sharer keeps ``own``: one block too many
            node.block_ids[-1] = own[0]
            self._num_retained_blocks -= retained
            self._blocks.unref(donor.block_ids[:1], hold=held)
            return 0
        held_change = sum(map(self._held_share, touched)) - held_before
        freed = self._blocks.unref(own, hold=held)
        if not freed and held and not donor.lock_ref:  # undo: see the docstring
            self._blocks.ref(own, hold=held)
            node.block_ids[-1] = own[0]
            self._num_retained_blocks -= retained
            self._blocks.unref(donor.block_ids[:1], hold=held)
            return 0
        self._num_held_blocks += held_change
        return freed

    def drop_redundant_copies(self) -> int:
        """Every node ending inside a block that a child copied takes the child's copy
        (``_borrow_boundary_block``), locked or not: such a node's own copy sits on a
        locked path, or above a leaf, where eviction does not reach it. No cached token
        is lost; blocks only a sharing leaf still lists become evictable. Returns the
        blocks freed. O(candidates): the nodes a copying child was hung under since the
        last call (one swap each: a second would hand the block back and forth)."""
        candidates, self._copied_boundaries = self._copied_boundaries, {}
        return sum(self._borrow_boundary_block(node) for node in candidates.values())

    def drop_redundant_copies_on_path(self, node: RadixNode) -> int:
        """``drop_redundant_copies`` for the nodes on ``node``'s path (the root excluded),
        candidates or not: a candidate's swap may have been refused while it had two
        sharers, or freed nothing. Returns the blocks freed. O(depth * nodes inside a
        block)."""
        freed = 0
        while not node.is_root:
            freed += self._borrow_boundary_block(node)
            node = node.parent
        return freed

    def _frees_nothing(self, leaf: RadixNode) -> bool:
        """A leaf whose only block is the one it shares with a locked parent."""
        return (len(leaf.block_ids) == 1 and leaf.start % self.block_size != 0
                and leaf.parent.lock_ref > 0 and leaf.parent.block_ids[-1] == leaf.block_ids[0])

    def _is_pinned_end(self, node: RadixNode) -> bool:
        """Whether a pinned prefix ends at ``node`` (it must keep its end). O(1): the
        ``_pinned_ends`` index, not a scan of the pins, on the leaf-extend path."""
        return node.node_id in self._pinned_ends

    def _path_share(self, node: RadixNode) -> int:
        """The blocks ``node`` adds to its ancestors' distinct ones: all it lists, less its
        first when an ancestor lists it too. Summed over a set of nodes closed under
        ancestors (the locked ones, the retained ones) it counts their distinct blocks;
        splits and in-place growth keep that sum exact. O(nodes inside its first block)."""
        return len(node.block_ids) - self._shares_first(node)

    def _held_share(self, node: RadixNode) -> int:
        """``node``'s part of ``num_held_blocks``. O(nodes inside its first block)."""
        return self._path_share(node) if node.lock_ref else 0

    def _retained_share(self, node: RadixNode) -> int:
        """``node``'s part of ``num_retained_blocks``. O(nodes inside its first block)."""
        return self._path_share(node) if node.retain_count else 0

    def _fits_retained(self, node: RadixNode | None = None) -> bool:
        """Whether the retained blocks are within the bound; with ``node``, whether the
        context ending at ``node`` would be alone. O(depth) with ``node``, else O(1)."""
        if self.max_retained_blocks is None:
            return True
        if node is None:
            return self._num_retained_blocks <= self.max_retained_blocks
        context_blocks = 0
        while not node.is_root:
            context_blocks += self._path_share(node)
            node = node.parent
        return context_blocks <= self.max_retained_blocks

    def _shares_first(self, node: RadixNode) -> bool:
        """Whether an ancestor inside (or ending inside) ``node``'s first block lists it."""
        block_start = node.start // self.block_size * self.block_size
        if node.start == block_start:
            return False
        up = node.parent
        while not up.is_root:
            if up.block_ids[-1] == node.block_ids[0]:
                return True
            if up.start <= block_start:
                return False
            up = up.parent
        return False

    def _expire(self, now: float | None = None) -> None:
        """End every retention whose time is up. O(expired * (depth + log n))."""
        for retention in self.retentions.expired(self._now() if now is None else now):
            self._end_retention(retention)

    def _end_retention(self, retention: Retention) -> None:
        self.retentions.remove(retention)
        self._count_retention(retention.node, -1)

    def _count_retention(self, node: RadixNode, delta: int) -> None:
        """Add ``delta`` to the retain_count of ``node``'s path; count the blocks of the
        nodes whose retained flag flips and re-key the leaf among them (only a path's
        deepest node can be a leaf). O(depth + log n)."""
        while not node.is_root:
            was_retained = node.retain_count > 0
            node.retain_count += delta
            if was_retained != (node.retain_count > 0):
                share = self._path_share(node)
                self._num_retained_blocks += -share if was_retained else share
                if node.evict_key is not None:
                    self._refresh(node)
            node = node.parent

    def _touch_path(self, node: RadixNode) -> None:
        now = next(self._uses)
        while not node.is_root:
            node.last_access = now
            if node.evict_key is not None:
                self._refresh(node)
            node = node.parent

    def _discard(self, node: RadixNode) -> None:
        if node.evict_key is not None:
            self._evictable.remove((*node.evict_key, node))
            node.evict_key = None

    def _refresh(self, node: RadixNode) -> None:
        """Put ``node`` in the evictable set under its current key, or take it out."""
        self._discard(node)
        if not node.is_root and not node.children and node.lock_ref == 0:
            node.evict_key = _evict_key(node, self.block_size)
            self._evictable.add((*node.evict_key, node))

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert every invariant in the module docstring. O(nodes + cached tokens)."""
        bs = self.block_size
        expected_evictable = set()
        for ns, root in self._roots.items():
            if root.tokens.size or root.block_ids.size or root.lock_ref:
                raise RuntimeError(f"root of {ns!r} must be empty and unlocked")
            stack = [root]
            while stack:
                node = stack.pop()
                if node.namespace != ns:
                    raise RuntimeError(f"{node!r} sits under the root of {ns!r}")
                child_locks = 0
                for t, child in node.children.items():
                    if child.parent is not node or child.start != node.end:
                        raise RuntimeError(f"{child!r} is not attached at the end of {node!r}")
                    if not len(child.tokens) or int(child.tokens[0]) != t:
                        raise RuntimeError(f"{child!r} is keyed by {t} but starts otherwise")
                    if len(child.block_ids) != (child.end - 1) // bs - child.start // bs + 1:
                        raise RuntimeError(f"{child!r} holds the wrong number of blocks")
                    for array in (child.tokens, child.block_ids):
                        if array.dtype != np.int64 or array.base is not None:
                            raise RuntimeError(f"{child!r}: an array that is not its own int64")
                    if not node.is_root and child.priority > node.priority:
                        raise RuntimeError(f"{child!r} outranks its parent {node!r}")
                    if not node.is_root and child.retain_count > node.retain_count:
                        raise RuntimeError(f"{child!r} is retained more than its parent")
                    child_locks += child.lock_ref
                    stack.append(child)
                if not node.is_root and node.lock_ref < child_locks:
                    raise RuntimeError(f"{node!r} has fewer locks than its children")
                if not node.is_root and not node.children and node.lock_ref == 0:
                    expected_evictable.add(node.node_id)
                if (node.evict_key is not None
                        and node.evict_key != _evict_key(node, self.block_size)):
                    raise RuntimeError(f"{node!r} is in the evictable set under a stale key")
        actual = {entry[-2] for entry in self._evictable}
        if actual != expected_evictable or len(self._evictable) != len(actual):
            raise RuntimeError(f"evictable set {sorted(actual)} != unlocked leaves "
                               f"{sorted(expected_evictable)}")
        self._check_block_sharing()
        for node in self._copied_boundaries.values():
            if not self.is_attached(node):
                raise RuntimeError(f"{node!r} is a drop_redundant_copies candidate but is "
                                   "not in the tree")
        self._check_pins()
        self._check_retentions()

    def _check_block_sharing(self) -> None:
        listed: Counter[int] = Counter()  # block -> nodes listing it
        chained: Counter[int] = Counter()  # block -> (parent, child) pairs sharing it
        held: set[int] = set()
        for node in self.iter_nodes(all_namespaces=True):
            listed.update(node.block_ids.tolist())
            if node.lock_ref:
                held.update(node.block_ids.tolist())
            if self._path_share(node) < len(node.block_ids):
                chained[int(node.block_ids[0])] += 1
        shared_otherwise = [b for b, n in listed.items() if n != 1 + chained[b]]
        if shared_otherwise:
            raise RuntimeError(f"blocks {shared_otherwise[:8]} are listed by nodes that are "
                               "not a parent's last and its child's first block")
        if len(held) != self._num_held_blocks:
            raise RuntimeError(f"num_held_blocks {self._num_held_blocks} != {len(held)} "
                               "blocks of locked nodes")

    def _check_pins(self) -> None:
        for (ns, raw), node in self._pins.items():
            if self._roots.get(ns) is None or node.lock_ref < self._pin_counts[(ns, raw)]:
                raise RuntimeError(f"pinned {node!r} is not locked in the tree")
            if node.path_tokens().tobytes() != raw:
                raise RuntimeError(f"pinned {node!r} no longer spells its tokens")
        if self._pinned_ends != Counter(node.node_id for node in self._pins.values()):
            raise RuntimeError("the pinned-end index disagrees with the pins")


    def _check_retentions(self) -> None:
        self.retentions.check_invariants()
        expected: Counter[int] = Counter()
        for retention in self.retentions:
            node = retention.node
            if node.is_root or not self.is_attached(node):
                raise RuntimeError(f"a retention ends at {node!r}, which is not in the tree")
            while not node.is_root:
                expected[node.node_id] += 1
                node = node.parent
        retained_blocks: set[int] = set()
        for node in self.iter_nodes(all_namespaces=True):
            if node.retain_count != expected[node.node_id]:
                raise RuntimeError(f"{node!r}: retain_count {node.retain_count} != "
                                   f"{expected[node.node_id]} retentions through it")
            if node.retain_count:
                retained_blocks.update(node.block_ids.tolist())
        if len(retained_blocks) != self._num_retained_blocks or not self._fits_retained():
            raise RuntimeError(f"num_retained_blocks {self._num_retained_blocks} (recount "
                               f"{len(retained_blocks)}) miscounts or exceeds the bound "
                               f"{self.max_retained_blocks}")


def _evict_key(node: RadixNode, block_size: int) -> tuple[int, int, int, int, int]:
    """Ordinary before retained, then lower priority, then a partial tail block before
    full blocks, then least recently used."""
    return (int(node.retain_count > 0), node.priority, int(node.end % block_size == 0),
            node.last_access, node.node_id)


def _new_root(namespace: Hashable) -> RadixNode:
    return RadixNode(namespace, None, np.empty(0, TOKEN_DTYPE), 0, np.empty(0, BLOCK_DTYPE), 0)


def _block_array(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A node's own int64 copy of some of the caller's block ids. O(len(block_ids))."""
    return np.array(block_ids, dtype=BLOCK_DTYPE)
