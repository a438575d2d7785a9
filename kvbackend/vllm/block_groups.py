"""kvbackend's blocks spread over vLLM's KV-cache groups.

A model with interleaved sliding-window and full-attention layers has several
KV-cache groups (vLLM's hybrid KV-cache manager): each group has its own block
table, and all groups draw physical block ids from one shared pool (layers of
different groups share the KV tensors, so one physical block serves one group).

kvbackend caches every group along the same token boundaries: one *logical*
block, the unit of its tree and pool, is the scheduler's block (the least common
multiple of the groups' block sizes), and ``pages[g]`` consecutive physical blocks of
group ``g`` (more than one where vLLM gave the group a smaller block size: its layers
hold more bytes per token, as Gemma 4's full-attention layers do),

    physical(logical, group, j) = logical * stride + first[group] + j,  j < pages[group]

with ``stride = sum(pages)`` and ``first[group]`` the pages of the groups before it,
so a token-exact hit, a copy-on-write copy or an eviction covers all groups at
once, and with one group of the scheduler's block size the mapping is the identity.
Logical block 0 (the null block) covers physical blocks 0 .. stride - 1, vLLM's null
block among them.

A model with one full-attention group and either sliding-window groups or
Mamba / linear-attention state groups, served without a KV connector other than
kvbackend's tiers, holds a block's pages in the other groups only while they are
needed instead (``PagedBlockGroups``): there a logical block is its full-attention
block, and its other pages come from ``GroupPages`` (sliding-window pages while a
window reaches the block, ``WindowPages``; state pages while a request's state runs
through it, or while it holds a cached state checkpoint).

The tier connector names a tier block by its logical id and moves its physical
blocks in every group (``tier_blocks``, read from vLLM's per-group block table):
one tier block holds every group's KV of its tokens. Where a sliding-window group
lists vLLM's null block (0) the block is not whole on the device: a load fills
the other groups, and it is never saved. A hybrid's ordinary tier copy holds its
attention pages only, so a null state page never keeps a block from a tier.

Invariants: the physical ids of distinct (logical, group, j) are distinct and below
``num_logical * stride <= num_physical``; group ``g``'s table lists ``pages[g]`` blocks
per logical block, so token ``t`` of logical block ``b`` lies in its ``t // block_size``-th
block there, as vLLM's workers address it (``check_invariants``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    BlockHash, KVCacheBlock, KVCacheBlockCopy, make_block_hash_with_group_id,
)

from kvbackend.core.group_pages import GroupPages


class BlockGroups:
    """Maps logical block ids to vLLM's per-group physical blocks. O(1) per block and
    page."""

    def __init__(self, num_physical_blocks: int, pages: Sequence[int]) -> None:
        """``pages[g]``: group ``g``'s blocks in one logical block."""
        if not pages or min(pages) < 1:
            raise ValueError(f"every KV-cache group needs a block per logical block, got "
                             f"{list(pages)}")
        self.num_groups, self.pages = len(pages), tuple(pages)
        self.stride = sum(pages)
        self._first = [sum(pages[:g]) for g in range(self.num_groups)]
        self.num_paged_groups = 0  # every group keeps every block
        self.num_logical = num_physical_blocks // self.stride
        self._objects = [KVCacheBlock(i) for i in range(self.num_logical * self.stride)]

    def physical(self, logical: int, group: int) -> int:
        """``logical``'s first block in ``group``."""
        return logical * self.stride + self._first[group]

    def as_blocks(self, logical_ids: Iterable[int], first_in_window: int = 0) -> KVCacheBlocks:
        """One block list per group, in the order of ``logical_ids``, ``pages[g]`` blocks
        each in group ``g`` (every group keeps every block: ``first_in_window`` does not
        apply). O(pages * blocks)."""
        logical_ids = list(logical_ids)
        objects, stride = self._objects, self.stride
        return KVCacheBlocks(tuple(
            [objects[b * stride + first + j] for b in logical_ids for j in range(n)]
            for first, n in zip(self._first, self.pages)))

    def copies(self, pairs: Iterable[tuple[int, int]]) -> list[KVCacheBlockCopy]:
        """A logical (src, dst) copy is one physical copy per block of every group."""
        stride = self.stride
        return [KVCacheBlockCopy(src * stride + j, dst * stride + j)
                for src, dst in pairs for j in range(stride)]

    def check_invariants(self) -> None:
        """Every physical block belongs to one (logical, group, j), group by group in
        table order. O(physical blocks)."""
        seen = set()
        for logical in range(self.num_logical):
            table = self.as_blocks([logical]).blocks
            assert [len(ids) for ids in table] == list(self.pages)
            for group, ids in enumerate(table):
                assert ids[0].block_id == self.physical(logical, group)
                assert [b.block_id for b in ids] == list(range(ids[0].block_id,
                                                              ids[0].block_id + len(ids)))
                seen.update(b.block_id for b in ids)
        assert seen == set(range(self.num_logical * self.stride))

    def tier_blocks(self, per_group: Sequence[Sequence[int]], check: bool = False
                    ) -> tuple[Sequence[int], Sequence[tuple[int, ...]]]:
        """A request's tier blocks from vLLM's per-group table: their logical ids and,
        unless the logical block is one physical block, their physical blocks (group by
        group, ``pages[g]`` of group ``g``; one group of the logical size: the ids
        themselves, no tuples). ``check``: ``LogicalBlockIds.check``. O(1), or
        O(pages * blocks) checked."""
        if self.stride == 1:
            return per_group[0], ()
        logical = LogicalBlockIds(per_group, self.pages)
        if check:
            logical.check()
        return logical, PhysicalBlocks(per_group, self.pages)


class LogicalBlockIds(Sequence[int]):
    """A request's block table as logical ids, read from vLLM's per-group table (group 0's
    first physical block of each logical block, divided by the physical blocks of a
    logical one) without copying it. O(1) per item; ``check`` verifies that every group
    holds the same logical blocks. O(pages * blocks)."""

    def __init__(self, per_group: Sequence[Sequence[int]], pages: Sequence[int]) -> None:
        self.per_group, self.pages, self.stride = per_group, pages, sum(pages)

    def __len__(self) -> int:
        return len(self.per_group[0]) // self.pages[0]

    def __getitem__(self, i):  # type: ignore[override]
        first, k = self.per_group[0], self.pages[0]
        if isinstance(i, slice):
            return [first[j * k] // self.stride for j in range(len(self))[i]]
        return first[i * k] // self.stride

    def check(self) -> None:
        """Raise ValueError unless group g's blocks are, for each logical block ``b``,
        ``b * stride + first[g] + j`` (kvbackend's manager hands out no other table)."""
        logical, offset = list(self), 0
        for group, (ids, k) in enumerate(zip(self.per_group, self.pages)):
            want = [b * self.stride + offset + j for b in logical for j in range(k)]
            if list(ids) != want:
                raise ValueError(f"KV-cache group {group}'s blocks are not those of group 0's "
                                 "logical blocks (a block table kvbackend's manager did not "
                                 "make)")
            offset += k


class PhysicalBlocks(Sequence[tuple[int, ...]]):
    """Each logical block's physical blocks in every group, group by group, read from
    vLLM's per-group table without copying it (0: the group lists its null block there).
    O(pages) per item."""

    def __init__(self, per_group: Sequence[Sequence[int]], pages: Sequence[int]) -> None:
        self.per_group, self.pages = per_group, pages

    def __len__(self) -> int:
        return len(self.per_group[0]) // self.pages[0]

    def __getitem__(self, i: int) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(b for ids, k in zip(self.per_group, self.pages)
                     for b in ids[i * k:(i + 1) * k])


class PagedBlockGroups:
    """Logical blocks of a model with one full-attention group whose other groups'
    pages a block holds only for a while (``GroupPages``: sliding-window pages while a
    window reaches it, ``WindowPages``; state pages while a request's state runs
    through it or a checkpoint stays cached): a logical block is its physical block in
    the full-attention group, and its physical block in another group is its page
    there, or vLLM's null block (0) where it has none or the request's window no longer
    reaches it. O(1) per block and group."""

    def __init__(self, num_physical_blocks: int, full_group: int, paged_groups: Sequence[int],
                 pages: GroupPages) -> None:
        self.num_groups = 1 + len(paged_groups)
        self.num_paged_groups = len(paged_groups)
        self.num_logical = num_physical_blocks
        self.full_group, self.pages = full_group, pages
        self._paged_index = {group: k for k, group in enumerate(paged_groups)}
        self._objects = [KVCacheBlock(i) for i in range(num_physical_blocks)]
        self._objects[0].is_null = True  # vLLM's null block, listed where there is no page

    def physical(self, logical: int, group: int) -> int:
        """``logical``'s block in ``group``; KeyError where it has no page there."""
        if group == self.full_group:
            return logical
        return self.pages.pages(logical)[self._paged_index[group]]

    def as_blocks(self, logical_ids: Iterable[int], first_in_window: int = 0) -> KVCacheBlocks:
        """One block list per group; in the other groups the blocks before index
        ``first_in_window``, and those without pages, are the null block.
        O(groups * blocks)."""
        logical_ids, objects, pages = list(logical_ids), self._objects, self.pages
        null = objects[0]
        per_group = []
        for group in range(self.num_groups):
            if group == self.full_group:
                per_group.append([objects[b] for b in logical_ids])
                continue
            k = self._paged_index[group]
            per_group.append([null] * min(first_in_window, len(logical_ids)) + [
                objects[pages.pages(b)[k]] if pages.has_pages(b) else null
                for b in logical_ids[first_in_window:]])
        return KVCacheBlocks(tuple(per_group))

    def copies(self, pairs: Iterable[tuple[int, int]]) -> list[KVCacheBlockCopy]:
        """A logical (src, dst) copy is one physical copy per group (both blocks have
        their pages: a copy's source is held until it ran)."""
        return [KVCacheBlockCopy(self.physical(src, group), self.physical(dst, group))
                for src, dst in pairs for group in range(self.num_groups)]

    def tier_blocks(self, per_group: Sequence[Sequence[int]], check: bool = False
                    ) -> tuple[Sequence[int], Sequence[tuple[int, ...]]]:
        """As ``BlockGroups.tier_blocks``: a logical id is the full-attention group's
        block id (nothing to check). O(1)."""
        return per_group[self.full_group], PhysicalBlocks(per_group, [1] * self.num_groups)


def with_block_hashes(blocks: KVCacheBlocks, hashes: Sequence[BlockHash]) -> KVCacheBlocks:
    """``blocks`` whose first ``len(hashes)`` blocks in every group carry vLLM's hash of
    their tokens (and group), as vLLM's block pool marks the blocks it cached; the others
    carry none, and null blocks stay null. The hashed blocks are new objects: kvbackend's
    own stay unhashed. O(groups * blocks)."""
    def hashed(block: KVCacheBlock, block_hash: BlockHash, group: int) -> KVCacheBlock:
        if block.is_null:
            return block
        marked = KVCacheBlock(block.block_id)
        marked.set_block_hash(make_block_hash_with_group_id(block_hash, group))
        return marked

    return KVCacheBlocks(tuple(
        [hashed(b, h, g) for b, h in zip(blocks, hashes)] + list(blocks[len(hashes):])
        for g, blocks in enumerate(blocks.blocks)))
