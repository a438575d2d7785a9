"""Sequences over a block pool, sharing cached prefixes through a radix tree.

A *sequence* is one request's block table. It starts from a prefix match,
grows block by block, publishes its tokens to the tree with ``cache`` and ends
with ``release``. Copy-on-write keeps every block a sequence writes private:

    match: [ full | full | part· ]        cached, shared; part is valid up to ·
    seq:   [ full | full | copy·.... ]    full blocks shared (one ref each);
                                          the partial block is copied into a new
                                          block the sequence owns, and it writes
                                          its own tokens from · on

Copies are not made here: ``take_block_copies`` hands ``BlockCopy`` orders to the
engine, which runs them before the next forward pass, then calls
``complete_block_copies``; until then the source block is held.

A caller may hold blocks outside any table (``extra_blocks`` allocated beside a
sequence's new ones): another KV-cache group's pages of the sequence's
blocks, say. It frees them with ``free_blocks``; those it can give up on demand it
names through its ``Reclaimer``, which ``_allocate`` interleaves with the tree's
eviction in one least-recently-used order.

Invariants (checked by ``check_invariants``, on top of the tree's and the pool's):
    * ref_cnt[b] == #(live sequences listing b) + #(tree nodes listing b) + #(copies reading b)
                    + (1 if the caller holds b)
    * hold_cnt[b] == #(sequences listing b) + #(locked nodes listing b) + #(copies reading b)
                     + (1 if the caller holds b)
    * lock_ref(node) == #(sequences and pins locked on the node's subtree)
    * a sequence owns ceil(num_tokens / block_size) blocks or more; its last block
      (the one it writes) is referenced by nothing else while it is partial
    * a sequence's locked node covers its ``num_locked_tokens`` (the root for 0); it
      ends there when locked (a longer entry is split), and runs past it only where
      another sequence's insert extended that leaf since
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kvbackend.core.block_pool import BlockPool
from kvbackend.core.miss_diagnosis import Admission, LostSpan, diagnose
from kvbackend.core.radix_node import PrefixMatch, RadixNode
from kvbackend.core.radix_tree import RadixTree
from kvbackend.core.seen_prefixes import PrefixDigests, SeenPrefixes
from kvbackend.core.token_ops import as_token_array, cdiv


class Reclaimer(Protocol):
    """The caller's blocks that the pool may take back, oldest first."""

    @property
    def num_reclaimable(self) -> int:
        """Blocks ``reclaim_oldest`` can free, all calls together."""

    def oldest_key(self) -> tuple[int, int, int, int] | None:
        """The oldest's place in the tree's eviction order (``first_victim_key``)."""

    def reclaim_oldest(self) -> None:
        """Free the oldest (``free_blocks``)."""


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the first ``num_tokens`` slots of block ``src`` into block ``dst``."""

    src: int
    dst: int
    num_tokens: int


class BlockCounts(NamedTuple):
    """The pool's blocks: ``usable`` (all but the null block) == ``free`` + evictable
    (cached, held by no one) + ``held`` (by sequences, locked nodes or pending copies)."""

    usable: int
    free: int
    held: int


@dataclass(eq=False, slots=True)
class Sequence:
    """A request's block table. ``block_ids[i]`` holds positions [i*bs, (i+1)*bs)."""

    seq_id: int
    namespace: Hashable
    block_ids: list[int]
    num_tokens: int
    node: RadixNode = field(repr=False)  # the locked node, deepest known cached point
    num_locked_tokens: int  # tokens of the sequence covered by ``node``'s path
    released: bool = False
    # the caller's blocks allocated by the last open_sequence / extend (extra_blocks)
    extra_block_ids: list[int] = field(default_factory=list, repr=False)


class PrefixCache:
    """Radix tree + block pool + live sequences: the engine-agnostic cache.

    ``None`` means "not enough blocks now" (nothing was changed); misuse raises
    ``ValueError``. At most ``max_pinned_fraction`` of the usable blocks are pinned
    and ``max_retained_fraction`` retained (``release(retain_s=...)``); ``clock``
    (seconds) times retentions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        reserve_null_block: bool = True,
        max_pinned_fraction: float = 0.5,
        max_retained_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("max_pinned_fraction", max_pinned_fraction),
                            ("max_retained_fraction", max_retained_fraction)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, reserve_null_block=reserve_null_block)
        self.tree = RadixTree(
            block_size, self.pool, clock=clock,
            max_retained_blocks=int(max_retained_fraction * self.pool.num_usable_blocks))
        self.max_pinned_blocks = int(max_pinned_fraction * self.pool.num_usable_blocks)
        self._pinned_blocks: dict[tuple[Hashable, bytes], int] = {}
        self._sequences: dict[int, Sequence] = {}
        self._ids = itertools.count(1)
        self._pending_copies: list[BlockCopy] = []
        self._in_flight_copies: list[BlockCopy] = []
        self._caller_blocks: set[int] = set()
        self.reclaimer: Reclaimer | None = None

    # ---------------------------------------------------------------- queries
    def match(
        self, tokens: Seq[int] | np.ndarray, namespace: Hashable = None, *,
        max_tokens: int | None = None, touch: bool = True
    ) -> PrefixMatch:
        """Longest cached prefix of ``tokens[:max_tokens]``; with ``touch`` it marks the
        path as used. O(depth + matched tokens + matched blocks); see ``RadixTree.match``."""
        tokens = as_token_array(tokens)
        return self.tree.match(tokens if max_tokens is None else tokens[:max_tokens], namespace,
                               touch=touch)

    def is_current(self, match: PrefixMatch) -> bool:
        """Whether ``match`` still describes the cache (``open_sequence`` accepts it). O(depth)."""
        return self.tree.is_current(match)

    def published_blocks(self, block_ids: Iterable[int]) -> set[int]:
        """Those of ``block_ids`` that a cached prefix lists (matchable). O(nodes)."""
        wanted = set(block_ids)
        found: set[int] = set()
        for node in self.tree.iter_nodes(all_namespaces=True):
            found.update(wanted.intersection(node.block_ids.tolist()))
        return found

    def record_query(self, namespace: Hashable, num_query_tokens: int,
                     num_hit_tokens: int) -> None:
        """Count one lookup of ``namespace`` in its ``NamespaceStats``. O(1)."""
        self.tree.record_query(namespace, num_query_tokens, num_hit_tokens)

    def diagnose_miss(self, seen: SeenPrefixes, digests: PrefixDigests, prompt: np.ndarray,
                      namespace: Hashable, admission: Admission) -> list[LostSpan]:
        """Why ``prompt`` reused no more than it did; reads the cache only.
        See ``miss_diagnosis.diagnose`` (its complexity too)."""
        return diagnose(self.tree, seen, digests, prompt, namespace, admission)

    def drop_redundant_copies(self, seq: Sequence | None = None) -> int:
        """Blocks cached prefixes hold although their continuations copied them, freed
        (``RadixTree.drop_redundant_copies``); no cached token is lost. Live sequences
        are unaffected: they list their own blocks. With ``seq``, every node on its
        locked prefix tries too (``drop_redundant_copies_on_path``). O(candidates), plus
        O(depth * nodes inside a block) with ``seq``."""
        freed = self.tree.drop_redundant_copies()
        if seq is not None:
            freed += self.tree.drop_redundant_copies_on_path(seq.node)
        return freed

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now, evicting (and reclaiming) as needed.
        O(1)."""
        reclaimable = self.reclaimer.num_reclaimable if self.reclaimer is not None else 0
        return self.pool.num_free + self.pool.num_evictable + reclaimable

    def block_counts(self) -> BlockCounts:
        """The pool's usable blocks and how many are free and held. O(1)."""
        pool = self.pool
        return BlockCounts(pool.num_usable_blocks, pool.num_free, pool.num_held)

    @property
    def caller_blocks(self) -> set[int]:
        """The blocks the caller holds outside any table (read only). O(1)."""
        return self._caller_blocks

    @property
    def sequences(self) -> list[Sequence]:
        return list(self._sequences.values())

    # ---------------------------------------------------------- sequence life
    def open_sequence(self, match: PrefixMatch, num_tokens: int | None = None, *,
                      extra_blocks: int = 0) -> Sequence | None:
        """Start a sequence from ``match`` with room for ``num_tokens`` (default: the match),
        and ``extra_blocks`` more for the caller (``Sequence.extra_block_ids``).

        Shares the matched full blocks; a partial block is copied on write. Only the
        matched prefix is locked (a node running past it is split), so the pool
        supplies the blocks whenever enough are allocatable outside that prefix.
        Complexity: O(depth + blocks + tokens of a split node). Returns None when the
        pool cannot supply the blocks, changing nothing but that split (and which copy of
        a block some nodes list: ``drop_redundant_copies``).
        """
        if not self.tree.is_current(match):
            raise ValueError("stale PrefixMatch: the cache changed since the match; match again")
        total = match.num_tokens if num_tokens is None else num_tokens
        if total < match.num_tokens:
            raise ValueError(f"num_tokens {total} is below the {match.num_tokens} matched tokens")
        shared = list(match.block_ids[: match.num_full_blocks])
        num_new = cdiv(total, self.block_size) - len(shared)
        # Lock exactly the matched prefix: a node running past it is split first, so
        # its unmatched tail stays evictable for the allocation below.
        node = self._node_ending_at(match.node, match.num_tokens)
        self.tree.lock(node)  # keeps the matched blocks out of eviction below
        source = [match.block_ids[-1]] if match.num_partial_tokens else []
        self.pool.ref(source, hold=True)  # the copy's: a node may drop its own (_allocate)
        new_blocks = self._allocate(num_new + extra_blocks, node)
        if new_blocks is None:
            self.pool.unref(source, hold=True)
            self.tree.unlock(node)
            return None
        new_blocks, extras = self._split_extras(new_blocks, extra_blocks)
        self.pool.ref(shared, hold=True)
        if source:
            self._pending_copies.append(BlockCopy(source[0], new_blocks[0],
                                                  match.num_partial_tokens))
        seq = Sequence(next(self._ids), node.namespace, shared + new_blocks, total, node,
                       match.num_tokens, extra_block_ids=extras)
        self._sequences[seq.seq_id] = seq
        return seq

    def extend(self, seq: Sequence, num_tokens: int, *, extra_blocks: int = 0) -> list[int] | None:
        """Grow ``seq`` to ``num_tokens`` tokens; returns the new block ids (maybe none),
        with ``extra_blocks`` more for the caller in ``seq.extra_block_ids``.

        All or nothing: None means the pool could not supply them. O(new blocks).
        """
        self._check_live(seq)
        if num_tokens < seq.num_tokens:
            raise ValueError(f"a sequence cannot shrink ({seq.num_tokens} -> {num_tokens} tokens)")
        num_new = cdiv(num_tokens, self.block_size) - len(seq.block_ids)
        new_blocks = self._allocate(num_new + extra_blocks, seq.node)
        if new_blocks is None:
            return None
        new_blocks, seq.extra_block_ids = self._split_extras(new_blocks, extra_blocks)
        seq.block_ids.extend(new_blocks)
        seq.num_tokens = num_tokens
        return new_blocks

    def cache(self, seq: Sequence, tokens: Seq[int] | np.ndarray, *, priority: int = 0) -> int:
        """Publish ``tokens`` (the first ``len(tokens)`` tokens of ``seq``) to the tree.

        Their KV must be in ``seq``'s blocks, or be written there before any other
        sequence reads it (the engine's next forward pass). Returns how many tokens
        were new to the tree. Complexity: O(depth + len(tokens) + blocks).
        """
        self._check_live(seq)
        tokens = as_token_array(tokens)
        if len(tokens) > seq.num_tokens:
            raise ValueError(f"cannot cache {len(tokens)} tokens of a "
                             f"{seq.num_tokens}-token sequence")
        result = self.tree.insert(tokens, seq.block_ids, seq.namespace, priority=priority,
                                  caller_lock=seq.node)
        if len(tokens) >= seq.num_locked_tokens:  # insert split: result.node ends there
            self.tree.lock(result.node)
            self.tree.unlock(seq.node)
            seq.node, seq.num_locked_tokens = result.node, len(tokens)
        return len(tokens) - result.num_existing_tokens

    def replace_blocks(self, seq: Sequence, tokens: Seq[int] | np.ndarray,
                       replace: Callable[[int, int], bool]) -> list[tuple[int, int]]:
        """Where the tree lists, for a block of ``seq``'s published ``tokens``, another
        block than ``seq`` and ``replace(listed, own)`` says so, it lists ``seq``'s
        instead (``RadixTree.replace_blocks``: a block nodes share included, where
        ``tokens`` cover all of theirs). O(depth + blocks)."""
        self._check_live(seq)
        return self.tree.replace_blocks(as_token_array(tokens), seq.namespace, seq.block_ids,
                                        replace)

    def fork(self, seq: Sequence) -> Sequence | None:
        """A second sequence with the same tokens (n > 1 sampling, beam search).

        Shares every full block; a partial last block is copied on write.
        Returns None when no block is free for that copy. O(blocks).
        """
        self._check_live(seq)
        num_full = seq.num_tokens // self.block_size
        num_partial = seq.num_tokens % self.block_size
        self.tree.lock(seq.node)
        copy = self._allocate(1 if num_partial else 0)
        if copy is None:
            self.tree.unlock(seq.node)
            return None
        shared = seq.block_ids[:num_full]
        self.pool.ref(shared, hold=True)
        if num_partial:
            self._order_copy(seq.block_ids[num_full], copy[0], num_partial)
        child = Sequence(next(self._ids), seq.namespace, shared + copy, seq.num_tokens, seq.node,
                         seq.num_locked_tokens)
        self._sequences[child.seq_id] = child
        return child

    def _node_ending_at(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """The node of ``node``'s path ending exactly at ``num_tokens`` (the root for 0),
        splitting the one that runs past it: a sequence locks exactly its prefix, so the
        rest of a longer cached entry stays evictable. O(depth + tokens of a split node)."""
        return self.tree.split_at(node, num_tokens) if num_tokens else node

    def release(self, seq: Sequence, *, retain_s: float = 0) -> bool:
        """Drop ``seq``'s blocks and lock; cached blocks stay matchable. With ``retain_s``
        the tokens it cached (``num_locked_tokens``) stay ahead of ordinary entries
        that long (``RadixTree.retain``); returns whether they are retained.
        O(depth + blocks), plus ``retain``'s cost.
        """
        self._check_live(seq)
        retained = False
        if retain_s:  # nothing cached (a root): validated, not retained
            retained = self.tree.retain(
                self._node_ending_at(seq.node, seq.num_locked_tokens), retain_s)
        seq.released = True
        del self._sequences[seq.seq_id]
        self.pool.unref(seq.block_ids, hold=True)
        self.tree.unlock(seq.node)
        return retained

    # -------------------------------------------------------------- retention
    def pin(self, tokens: Seq[int] | np.ndarray, namespace: Hashable = None) -> bool:
        """Keep a cached prefix resident until ``unpin``. False when it is not fully
        cached or pinning it would exceed ``max_pinned_fraction`` of the pool."""
        tokens = as_token_array(tokens)
        key = (namespace, tokens.tobytes())
        if key in self._pinned_blocks:
            return True
        cost = cdiv(len(tokens), self.block_size)
        if sum(self._pinned_blocks.values()) + cost > self.max_pinned_blocks:
            return False
        if not self.tree.pin(tokens, namespace):
            return False
        self._pinned_blocks[key] = cost
        return True

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks the pinned prefixes cover (what ``max_pinned_fraction`` bounds). O(pins)."""
        return sum(self._pinned_blocks.values())

    def unpin(self, tokens: Seq[int] | np.ndarray, namespace: Hashable = None) -> None:
        self.tree.unpin(tokens, namespace)
        del self._pinned_blocks[(namespace, as_token_array(tokens).tobytes())]

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` cached blocks no one holds. O(k log n)."""
        return self.tree.evict(num_blocks)

    def clear(self) -> None:
        """Drop every pin, every retention and every cached block no sequence holds."""
        self.tree.unpin_all()
        self.tree.drop_retentions()
        self._pinned_blocks.clear()
        self.tree.evict(self.pool.num_blocks)

    # ---------------------------------------------------------- caller blocks
    def allocate_blocks(self, n: int) -> list[int] | None:
        """``n`` blocks for the caller outside any table, evicting (and reclaiming) as
        ``open_sequence`` does; None when the pool cannot supply them. O(n + evictions)."""
        blocks = self._allocate(n)
        if blocks is not None:
            self._caller_blocks.update(blocks)
        return blocks

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Return the caller's blocks to the pool. O(len(block_ids))."""
        block_ids = list(block_ids)
        if not self._caller_blocks.issuperset(block_ids):
            raise ValueError(f"blocks {sorted(set(block_ids) - self._caller_blocks)} are not "
                             "the caller's")
        self._caller_blocks.difference_update(block_ids)
        self.pool.unref(block_ids, hold=True)

    def _split_extras(self, blocks: list[int], num_extra: int) -> tuple[list[int], list[int]]:
        """The last ``num_extra`` of freshly allocated ``blocks`` become the caller's."""
        cut = len(blocks) - num_extra
        self._caller_blocks.update(blocks[cut:])
        return blocks[:cut], blocks[cut:]

    # ------------------------------------------------------------------ copies
    def take_block_copies(self) -> list[BlockCopy]:
        """Copies the engine must run before its next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        self._in_flight_copies.extend(copies)
        return copies

    def complete_block_copies(self) -> None:
        """The engine ran every taken copy: release their sources."""
        self.pool.unref([c.src for c in self._in_flight_copies], hold=True)
        self._in_flight_copies.clear()

    # ---------------------------------------------------------------- helpers
    def _allocate(self, n: int, path: RadixNode | None = None) -> list[int] | None:
        """``n`` free blocks, evicting as needed (with a ``reclaimer``, the tree's victim
        or the caller's oldest reclaimable block, whichever is older, one at a time).
        Where those fall short, nodes whose continuations copied their last block give
        up their own copy first (``drop_redundant_copies``, only then), and then those
        on ``path`` (the locked prefix of the sequence that needs the blocks), whether or
        not they are candidates: a locked node keeps its own copy until it is unlocked,
        so a sequence could wait for a block its own prefix holds."""
        if n <= self.pool.num_free:  # the common case (a decode step: often none)
            return self.pool.allocate(n)
        if n > self.num_allocatable_blocks:
            self.drop_redundant_copies()
        if n > self.num_allocatable_blocks and path is not None:
            self.tree.drop_redundant_copies_on_path(path)
        if n > self.num_allocatable_blocks:
            return None
        if self.reclaimer is None:
            if n > self.pool.num_free:
                self.tree.evict(n - self.pool.num_free)
        else:
            self._evict_or_reclaim(n)
        return self.pool.allocate(n)

    def _evict_or_reclaim(self, n: int) -> None:
        """Free blocks until ``n`` are free: the tree's first victim or the reclaimer's
        oldest, whichever comes first in the tree's eviction order. O(k log n) for k
        blocks freed."""
        reclaimer = self.reclaimer
        while self.pool.num_free < n:
            oldest, victim = reclaimer.oldest_key(), self.tree.first_victim_key()
            if oldest is not None and (victim is None or oldest < victim):
                reclaimer.reclaim_oldest()
            elif not self.tree.evict(1):
                if oldest is None:
                    return
                reclaimer.reclaim_oldest()

    def _order_copy(self, src: int, dst: int, num_tokens: int) -> None:
        self.pool.ref([src], hold=True)
        self._pending_copies.append(BlockCopy(src, dst, num_tokens))

    def _check_live(self, seq: Sequence) -> None:
        if seq.released or self._sequences.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} was already released")

    def check_invariants(self) -> None:
        """Recount every reference, hold and lock from scratch. O(nodes + blocks)."""
        self.pool.check_invariants()
        self.tree.check_invariants()
        refs: Counter[int] = Counter()
        holds: Counter[int] = Counter()
        locks: Counter[int] = Counter()
        for seq in self._sequences.values():
            if len(seq.block_ids) < cdiv(seq.num_tokens, self.block_size):
                raise RuntimeError(f"sequence {seq.seq_id} has too few blocks")
            if (seq.node.end if not seq.node.is_root else 0) < seq.num_locked_tokens:
                raise RuntimeError(f"sequence {seq.seq_id} locks {seq.node!r}, short of "
                                   f"its {seq.num_locked_tokens} cached tokens")
            refs.update(seq.block_ids)
            holds.update(seq.block_ids)
            locks[seq.node.node_id] += 1
        for node, count in self.tree.pins():
            locks[node.node_id] += count
        for copy in self._pending_copies + self._in_flight_copies:
            refs[copy.src] += 1
            holds[copy.src] += 1
        refs.update(self._caller_blocks)
        holds.update(self._caller_blocks)
        subtree_locks: dict[int, int] = {}
        for node in sorted(self.tree.iter_nodes(all_namespaces=True), key=lambda n: -n.start):
            refs.update(node.block_ids)
            if node.lock_ref:
                holds.update(node.block_ids)
            below = sum(subtree_locks.get(c.node_id, 0) for c in node.children.values())
            subtree_locks[node.node_id] = below + locks[node.node_id]
            if node.lock_ref != subtree_locks[node.node_id]:
                raise RuntimeError(f"{node!r}: lock_ref != "
                                   f"{subtree_locks[node.node_id]} locks below")
        for b in range(self.pool.num_blocks):
            if self.pool.ref_cnt[b] != refs[b] or self.pool.hold_cnt[b] != holds[b]:
                raise RuntimeError(
                    f"block {b}: ref_cnt {self.pool.ref_cnt[b]} / hold_cnt {self.pool.hold_cnt[b]} "
                    f"!= {refs[b]} holders / {holds[b]} holding")
        listed = Counter(b for seq in self._sequences.values() for b in seq.block_ids)
        for seq in self._sequences.values():
            if seq.num_tokens % self.block_size:
                written = seq.block_ids[seq.num_tokens // self.block_size]
                if listed[written] != 1:
                    raise RuntimeError(f"sequence {seq.seq_id} writes block {written}, "
                                       "which another sequence lists")
