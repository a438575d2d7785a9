"""A node of the compressed radix tree and the result of a prefix match."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

BLOCK_DTYPE = np.int64  # the dtype of RadixNode.block_ids


class RadixNode:
    """One edge of the tree: a run of tokens and the KV blocks that hold them.

    The node covers global token positions ``[start, end)`` of every sequence that
    passes through it, ``start == parent.end``. ``tokens`` and ``block_ids`` are
    int64 arrays the node owns (never views of another node's arrays).
    ``block_ids[i]`` is the block for block index ``start // block_size + i``; the
    node lists every block that overlaps ``[start, end)``, so a node that starts
    inside a block holds that block too: its parent's or a copy of it (each holder
    takes one reference). ``block_ids`` is empty only for a root.

    ``lock_ref`` counts the locks (running sequences, pins) taken on this node or
    any node below it; a node with ``lock_ref > 0`` is never evicted.
    """

    __slots__ = (
        "namespace",
        "parent",
        "children",
        "tokens",
        "start",
        "block_ids",
        "lock_ref",
        "retain_count",
        "priority",
        "last_access",
        "node_id",
        "evict_key",
    )

    def __init__(
        self,
        namespace: Hashable,
        parent: RadixNode | None,
        tokens: np.ndarray,
        start: int,
        block_ids: np.ndarray,
        node_id: int,
    ) -> None:
        self.namespace = namespace
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.tokens = tokens
        self.start = start
        self.block_ids = block_ids
        self.lock_ref = 0
        self.retain_count = 0
        self.priority = 0
        self.last_access = 0
        self.node_id = node_id
        # (retained, priority, last_access, node_id): its key in the evictable set, if in it
        self.evict_key: tuple[int, int, int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path_tokens(self) -> np.ndarray:
        """All tokens from the root to this node's end. O(depth + end)."""
        parts = []
        node: RadixNode | None = self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return np.concatenate(parts[::-1])

    def __repr__(self) -> str:
        blocks = self.block_ids.tolist()
        shown = blocks if len(blocks) <= 8 else [*blocks[:4], "...", *blocks[-2:]]
        return (f"RadixNode(id={self.node_id}, ns={self.namespace!r}, [{self.start}, {self.end}), "
                f"{len(blocks)} blocks {shown}, lock_ref={self.lock_ref})")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a query, token-exact.

    ``block_ids`` covers ``[0, num_tokens)``: ``num_full_blocks`` whole blocks,
    then -- when the prefix ends inside a block -- one block of which only the
    first ``num_partial_tokens`` slots are valid for this query. ``node`` is the
    deepest node holding the last matched token (the root when nothing matched);
    lock it to keep the blocks resident.
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    node: RadixNode
    block_size: int

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    @property
    def num_partial_tokens(self) -> int:
        return self.num_tokens % self.block_size

    @property
    def partial_block_id(self) -> int | None:
        return self.block_ids[-1] if self.num_partial_tokens else None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """``num_existing_tokens`` were cached before the insert; ``node`` ends at the
    last inserted token (or holds it, when the tokens were already cached)."""

    num_existing_tokens: int
    node: RadixNode
