"""kvbackend's blocks spread over vLLM's KV-cache groups.

A model with interleaved sliding-window and full-attention layers has several
KV-cache groups (vLLM's hybrid KV-cache manager): each group has its own block
table, and all groups draw physical block ids from one shared pool (layers of
different groups share the KV tensors, so one physical block serves one group).

kvbackend caches every group along the same token boundaries: one *logical*
block, the unit of its tree and pool, is one physical block per group,

    physical(logical, group) = logical * num_groups + group

so a token-exact hit, a copy-on-write copy or an eviction covers all groups at
once, and with one group the mapping is the identity. Logical block 0 (the null
block) covers physical blocks 0 .. num_groups - 1, vLLM's null block among them.

Invariants: the physical ids of distinct (logical, group) pairs are distinct and
below ``num_logical * num_groups <= num_physical``.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy


class BlockGroups:
    """Maps logical block ids to vLLM's per-group physical blocks. O(1) per block."""

    def __init__(self, num_physical_blocks: int, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"a model needs at least one KV-cache group, got {num_groups}")
        self.num_groups = num_groups
        self.num_logical = num_physical_blocks // num_groups
        self._objects = [KVCacheBlock(i) for i in range(self.num_logical * num_groups)]

    def physical(self, logical: int, group: int) -> int:
        return logical * self.num_groups + group

    def as_blocks(self, logical_ids: Iterable[int]) -> KVCacheBlocks:
        """One block list per group, in the order of ``logical_ids``. O(groups * blocks)."""
        logical_ids = list(logical_ids)
        objects, g = self._objects, self.num_groups
        return KVCacheBlocks(tuple([objects[b * g + group] for b in logical_ids]
                                   for group in range(g)))

    def copies(self, pairs: Iterable[tuple[int, int]]) -> list[KVCacheBlockCopy]:
        """A logical (src, dst) copy is one physical copy per group."""
        g = self.num_groups
        return [KVCacheBlockCopy(src * g + group, dst * g + group)
                for src, dst in pairs for group in range(g)]
