"""vLLM KV-cache events for the device blocks kvbackend caches.

Cache-aware routers read vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (``--kv-events-config``) and recompute block hashes from
token ids, so a block is announced under vLLM's own hash of the same tokens
(same hash function, ``NONE_HASH`` seed and extra keys: LoRA name, cache salt).

A full block is hashed once, when the tree first adopts it; its hash is kept
by block id, so the next block's parent hash is one dict read. Like vLLM,
kvbackend evicts on demand, when it hands blocks out again: a block that comes
back from the pool while still announced is announced removed then. Partial
blocks are never announced (vLLM hashes full blocks only). Only the device
medium is announced; host and disk tiers are not yet.

Invariant: ``hashes`` maps exactly the announced, not yet removed block ids.
Cost: O(1) per block stored or removed, nothing at all on lookups.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHash, generate_block_hash_extra_keys, hash_block_tokens, init_none_hash,
    maybe_convert_block_hash, to_event_extra_keys,
)
from vllm.v1.request import Request
from vllm.utils.hashing import get_hash_fn_by_name


class DeviceBlockEvents:
    """The events of one step, in the order they happened."""

    def __init__(self, hash_algo: str, block_size: int) -> None:
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            init_none_hash(self.hash_fn)  # vLLM does it only with its own prefix caching on
        self.block_size = block_size
        self.hashes: dict[int, BlockHash] = {}
        self._events: list[KVCacheEvent] = []

    def stored(self, request: Request, tokens: Any, block_ids: list[int], first: int,
               end: int) -> None:
        """Blocks ``first .. end - 1`` of ``block_ids`` became full and cached:
        ``tokens`` (the request's) fill them."""
        bs = self.block_size
        parent = self._parent_hash(request, tokens, block_ids, first)
        for i in range(first, end):
            block_id = block_ids[i]
            if block_id in self.hashes:  # republished: announced already
                parent = self.hashes[block_id]
                continue
            block_tokens = tokens[i * bs:(i + 1) * bs].tolist()
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            block_hash = hash_block_tokens(self.hash_fn, parent, block_tokens, extra)
            lora = request.lora_request
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(block_hash)],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=block_tokens, block_size=bs,
                lora_id=lora.adapter_id if lora else None, medium=MEDIUM_GPU,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys([extra]),
                group_idx=0, session_id=request.session_id))
            self.hashes[block_id] = parent = block_hash

    def reused(self, block_ids: list[int]) -> None:
        """``block_ids`` were handed out again: those still announced are gone."""
        for block_id in block_ids:
            block_hash = self.hashes.pop(block_id, None)
            if block_hash is not None:
                self._events.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(block_hash)], medium=MEDIUM_GPU,
                    group_idx=0))

    def cleared(self) -> None:
        self.hashes.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _parent_hash(self, request: Request, tokens: Any, block_ids: list[int],
                     first: int) -> BlockHash | None:
        """The hash of block ``first - 1``: kept when that block was announced, else
        (it came from a tier load, or was announced under another block id)
        recomputed from the request's tokens. O(1), or O(first) blocks hashed."""
        if first == 0:
            return None
        known = self.hashes.get(block_ids[first - 1])
        if known is not None:
            return known
        bs, parent = self.block_size, None
        for i in range(first):
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            parent = hash_block_tokens(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs].tolist(),
                                       extra)
        return parent
