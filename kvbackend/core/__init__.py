"""Engine-agnostic prefix-cache core: never imports vLLM, SGLang or torch."""

from kvbackend.core.block_pool import BlockPool
from kvbackend.core.prefix_cache import BlockCopy, PrefixCache, Sequence
from kvbackend.core.radix_node import InsertResult, PrefixMatch, RadixNode
from kvbackend.core.radix_tree import BlockRefs, RadixTree
from kvbackend.core.stats import NamespaceStats
from kvbackend.core.token_ops import TokenBuffer, as_token_array, cdiv, common_prefix_length

__all__ = [
    "BlockCopy", "BlockPool", "BlockRefs", "InsertResult", "NamespaceStats", "PrefixCache",
    "PrefixMatch", "RadixNode", "RadixTree", "Sequence", "TokenBuffer", "as_token_array",
    "cdiv", "common_prefix_length",
]
