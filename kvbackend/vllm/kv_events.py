"""vLLM KV-cache events for the blocks kvbackend caches: device, host tier.

Cache-aware routers read vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (``--kv-events-config``) and recompute block hashes from
token ids, so a block is announced under vLLM's own hash of the same tokens
(same hash function, ``NONE_HASH`` seed and extra keys: LoRA name, cache salt).

A full device block is hashed once, when the tree first adopts it; its event is
kept by block id, so the next block's parent hash is one dict read. Like vLLM,
kvbackend evicts on demand, when it hands blocks out again: a block that comes
back from the pool while still announced is announced removed then. Partial
blocks are never announced (vLLM hashes full blocks only).

A tier copy (``medium`` "CPU" for the host tier, as vLLM's offloading connector
announces its CPU blocks) reuses the device block's event: no second hash. A
copy made before its device block is announced (a block loaded from disk is
published a step later, once the load is known good) waits for that
announcement; if the device block is handed out again first, the copy is never
announced. Disk and remote blocks are not announced: other processes and the
workers evict them, unseen here.

Invariants (``check_invariants``): ``announced`` holds exactly the device blocks
announced and not removed since; ``tier_copies`` exactly the tier keys announced
and not removed since; a key waits for at most one device block, and a waiting
key is not announced.
Cost: O(1) per block stored, removed or copied; nothing at all on lookups.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
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


class _Announced(NamedTuple):
    block_hash: BlockHash  # vLLM's raw hash: the parent of the next block's
    event: BlockStored


class BlockEvents:
    """The events of one step, in the order they happened."""

    def __init__(self, hash_algo: str, block_size: int) -> None:
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            init_none_hash(self.hash_fn)  # vLLM does it only with its own prefix caching on
        self.block_size = block_size
        self.announced: dict[int, _Announced] = {}  # device block id -> its announcement
        self.tier_copies: dict[str, BlockStored] = {}  # tier key -> its announcement
        self._waiting: dict[int, dict[str, str]] = {}  # device block id -> {key: medium}
        self._waits_on: dict[str, int] = {}  # key -> the device block it waits for
        self._events: list[KVCacheEvent] = []

    # ---------------------------------------------------------------- device
    def stored(self, request: Request, tokens: Any, block_ids: list[int], first: int,
               end: int) -> None:
        """Blocks ``first .. end - 1`` of ``block_ids`` became full and cached:
        ``tokens`` (the request's) fill them."""
        bs = self.block_size
        parent = self._parent_hash(request, tokens, block_ids, first)
        for i in range(first, end):
            block_id = block_ids[i]
            if block_id in self.announced:  # republished: announced already
                parent = self.announced[block_id].block_hash
                continue
            block_tokens = tokens[i * bs:(i + 1) * bs].tolist()
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            block_hash = hash_block_tokens(self.hash_fn, parent, block_tokens, extra)
            lora = request.lora_request
            event = BlockStored(
                block_hashes=[maybe_convert_block_hash(block_hash)],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=block_tokens, block_size=bs,
                lora_id=lora.adapter_id if lora else None, medium=MEDIUM_GPU,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys([extra]),
                group_idx=0, session_id=request.session_id)
            self._events.append(event)
            self.announced[block_id] = _Announced(block_hash, event)
            parent = block_hash
            for key, medium in self._waiting.pop(block_id, {}).items():
                del self._waits_on[key]
                self._announce_copy(key, event, medium)

    def reused(self, block_ids: list[int]) -> None:
        """``block_ids`` were handed out again: those still announced are gone, and
        no waiting tier copy will ever match them."""
        for block_id in block_ids:
            for key in self._waiting.pop(block_id, {}):
                del self._waits_on[key]
            announced = self.announced.pop(block_id, None)
            if announced is not None:
                self._events.append(BlockRemoved(
                    block_hashes=announced.event.block_hashes, medium=MEDIUM_GPU,
                    group_idx=0))

    def cleared(self) -> None:
        """Every device block left the cache (``reset_prefix_cache``). vLLM's
        ``AllBlocksCleared`` names no medium, so the tier copies still held are
        announced again after it."""
        self.announced.clear()
        self._events.append(AllBlocksCleared())
        self._events.extend(self.tier_copies.values())

    # ----------------------------------------------------------------- tiers
    def tier_stored(self, key: str, block_id: int, medium: str) -> None:
        """The tier ``medium`` now holds (or is being sent) device block ``block_id``'s
        KV under ``key``; announced with the device block's hash, now or once the
        device block is announced."""
        if key in self.tier_copies or key in self._waits_on:
            return
        announced = self.announced.get(block_id)
        if announced is not None:
            self._announce_copy(key, announced.event, medium)
        else:
            self._waiting.setdefault(block_id, {})[key] = medium
            self._waits_on[key] = block_id

    def tier_removed(self, key: str) -> None:
        """The tier dropped ``key``."""
        block_id = self._waits_on.pop(key, None)
        if block_id is not None:
            waiting = self._waiting[block_id]
            del waiting[key]
            if not waiting:
                del self._waiting[block_id]
        event = self.tier_copies.pop(key, None)
        if event is not None:
            self._events.append(BlockRemoved(block_hashes=event.block_hashes,
                                             medium=event.medium, group_idx=0))

    def tier_cleared(self, medium: str) -> None:
        """The tier ``medium`` dropped every key. O(its keys)."""
        keys = [k for k, e in self.tier_copies.items() if e.medium == medium]
        keys += [k for k, b in self._waits_on.items() if self._waiting[b][k] == medium]
        for key in keys:
            self.tier_removed(key)

    # --------------------------------------------------------------- read-out
    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant (plain raises, so
        ``python -O`` keeps them). O(entries)."""
        waiting = {key: block_id for block_id, keys in self._waiting.items() for key in keys}
        if waiting != self._waits_on:
            raise RuntimeError("the two maps of waiting tier copies disagree")
        if not all(self._waiting.values()):
            raise RuntimeError("a device block waits with no tier copy")
        both = set(waiting) & set(self.tier_copies)
        if both:
            raise RuntimeError(f"tier keys {sorted(both)[:3]} both wait and are announced")

    def _announce_copy(self, key: str, event: BlockStored, medium: str) -> None:
        copy = msgspec.structs.replace(event, medium=medium)
        self.tier_copies[key] = copy
        self._events.append(copy)

    def _parent_hash(self, request: Request, tokens: Any, block_ids: list[int],
                     first: int) -> BlockHash | None:
        """The hash of block ``first - 1``: kept when that block was announced, else
        (it came from a tier load, or was announced under another block id)
        recomputed from the request's tokens. O(1), or O(first) blocks hashed."""
        if first == 0:
            return None
        known = self.announced.get(block_ids[first - 1])
        if known is not None:
            return known.block_hash
        bs, parent = self.block_size, None
        for i in range(first):
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            parent = hash_block_tokens(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs].tolist(),
                                       extra)
        return parent
