"""Tensor ops for moving KV blocks: gather / scatter / copy, and ``BlockMover`` between a
paged KV cache and the host/disk tiers. Imports torch; ``kvbackend.core`` never imports this."""

from kvbackend.ops.block_copy import (
    BlockCopier,
    BlockLayout,
    block_layout,
    copy_blocks,
    extension_available,
    gather_blocks,
    scatter_blocks,
)
from kvbackend.ops.block_mover import BlockMover

__all__ = [
    "BlockCopier", "BlockLayout", "BlockMover", "block_layout", "copy_blocks",
    "extension_available", "gather_blocks", "scatter_blocks",
]
