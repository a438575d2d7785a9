"""Tensor ops for moving KV blocks (imports torch; ``kvbackend.core`` never imports this)."""

from kvbackend.ops.block_copy import (
    BlockLayout,
    block_layout,
    copy_blocks,
    extension_available,
    gather_blocks,
    scatter_blocks,
)

__all__ = [
    "BlockLayout", "block_layout", "copy_blocks", "extension_available", "gather_blocks",
    "scatter_blocks",
]
