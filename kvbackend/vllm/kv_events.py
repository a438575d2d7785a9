"""vLLM KV-cache events for the blocks kvbackend caches: device, host, disk, remote.

Cache-aware routers read vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (``--kv-events-config``) and recompute block hashes from
token ids, so a block is announced under vLLM's own hash of the same tokens
(same hash function, ``NONE_HASH`` seed and extra keys: LoRA name, cache salt).

A full device block is hashed once, when the tree first adopts it; its event is
kept by block id, so the next block's parent hash is one dict read. Like vLLM,
kvbackend evicts on demand, when it hands blocks out again: a block that comes
back from the pool while still announced is announced removed then. Partial
blocks are never announced (vLLM hashes full blocks only). With several KV-cache
groups every event is published once per group, with its ``group_idx`` and the
group's ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` (``EventGroup``),
as vLLM's prefix caching does:

- attention groups (full and sliding-window): kvbackend announces every group's
  blocks of the whole prefix when it caches them; vLLM announces only the blocks a
  sliding window still reaches (an event whose ``token_ids`` span the whole
  range), so kvbackend's announcements cover vLLM's, hash for hash. Where a
  block's sliding-window pages are freed once out of every window
  (``WindowPages``), it is announced removed in those groups then
  (``window_removed``), and in the others when it leaves the cache;
- state groups (Mamba / linear attention, "align" mode): a block's state page is
  announced only once it holds a state checkpoint (``state_written``: a step ended
  on its last token, or a checkpoint is copied into it), as vLLM announces only
  the state blocks it keeps (the others are its null block); removed there when
  the block stops holding one (its state pages were freed: ``state_removed``), or
  with the block.

A tier copy reuses the device block's event: no second hash. The tiers are named
as vLLM's offloading tiers name theirs (``Tier``): host ``medium`` "CPU"; disk
"STORAGE" with ``locality`` "LOCAL" (vLLM's file-system tier); remote "STORAGE"
with ``locality`` "REMOTE" (its object-store tier). A copy made before its device
block is announced (a block loaded from a tier is published a step later, once
the load is known good) waits for that announcement; if the device block is
handed out again first, the copy is never announced.

What is announced for each tier (the tier connector's ``_announce_tier_changes``):

- host: stored when a save, a promoting load or a disk-to-host prefetch puts a
  block there (a prefetched block under its disk copy's announcement: one this
  process never announced, written by another process and not loaded here, is not
  announced in host either), removed when the planner drops it or clears the tier;
  as the scheduler decides every change of the workers' host tiers, exact but for
  a prefetch that fails on a worker (announced, not there: a hint, as below).
- disk and remote: stored when a save is ordered (written best effort after the
  step: a write that fails, a full remote queue, or a read-only disk drops it) and
  when a block is loaded from there; removed when the scheduler learns it is gone:
  a lookup or prefetch that probes the key finds no file on some rank (disk) or
  the server without it or out (remote; the first key after each tier's run of hits),
  a load of it fails (removed from disk and remote both), or the tiers go off
  (``reset_prefix_cache(reset_connector=True)``). Files that the workers' size
  bound or other processes evict, and keys the server expires, stay announced
  until then; blocks that other processes wrote are announced once loaded. So a
  router must take a "STORAGE" block as a hint: likely there, possibly gone; a
  hit it routes for that is gone is a miss, recomputed, never a wrong answer.
  (vLLM's own file-system and object-store tiers announce stores only, no
  removals at all.)

Invariants (``check_invariants``): ``announced`` holds exactly the device blocks
announced and not removed since; ``state_announced`` those of them whose state
page is announced too, and a checkpoint waiting for its block's announcement is
of a block not announced (none of either without a state group); ``tier_copies``
exactly the (tier, key) copies announced and not removed since, each announced
under its tier's medium and locality; a copy waits for at most one device block,
and a waiting copy is not announced.
Cost: O(groups) per block stored, removed or copied; nothing at all on lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored,
    KVCacheEvent,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHash, generate_block_hash_extra_keys, hash_block_tokens, init_none_hash,
    maybe_convert_block_hash, to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig, MambaSpec, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.kv_offload.base import Locality


class Tier(NamedTuple):
    """A tier as its events name it: vLLM's ``medium`` and ``locality``."""

    medium: str
    locality: str | None = None


HOST = Tier(MEDIUM_CPU)  # as vLLM's CPU offloading
DISK = Tier(MEDIUM_STORAGE, Locality.LOCAL.value)  # as vLLM's file-system tier
REMOTE = Tier(MEDIUM_STORAGE, Locality.REMOTE.value)  # as vLLM's object-store tier
_Copy = tuple[Tier, str]  # a tier copy: the tier and its key there


class EventGroup(NamedTuple):
    """A KV-cache group as its events name it."""

    kind: str
    sliding_window: int | None = None
    holds_state: bool = False  # Mamba / linear attention: announced per checkpoint


def event_groups(kv_cache_config: KVCacheConfig) -> tuple[EventGroup, ...]:
    """The engine's KV-cache groups, in ``group_idx`` order."""
    return tuple(EventGroup(get_kv_cache_spec_kind(group.kv_cache_spec).value,
                            get_kv_cache_spec_sliding_window(group.kv_cache_spec),
                            isinstance(group.kv_cache_spec, MambaSpec))
                 for group in kv_cache_config.kv_cache_groups)


class _Announced(NamedTuple):
    block_hash: BlockHash  # vLLM's raw hash: the parent of the next block's
    event: BlockStored


class BlockEvents:
    """The events of one step, in the order they happened, each published once per
    KV-cache group it concerns (``groups``: the engine's, ``event_groups``)."""

    def __init__(self, hash_algo: str, block_size: int, groups: Sequence[EventGroup]) -> None:
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            init_none_hash(self.hash_fn)  # vLLM does it only with its own prefix caching on
        self.block_size = block_size
        self.groups = tuple(groups)
        self.announced: dict[int, _Announced] = {}  # device block id -> its announcement
        self.state_announced: set[int] = set()  # announced blocks whose state page is too
        self._state_due: set[int] = set()  # checkpoints whose block is not announced yet
        self.tier_copies: dict[_Copy, BlockStored] = {}  # (tier, key) -> its announcement
        self._waiting: dict[int, dict[_Copy, None]] = {}  # device block id -> its copies
        self._waits_on: dict[_Copy, int] = {}  # copy -> the device block it waits for
        self._events: list[KVCacheEvent] = []
        self._windows_removed: set[int] = set()  # announced, gone from sliding-window groups

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
                session_id=request.session_id)
            self._emit(event)
            self.announced[block_id] = _Announced(block_hash, event)
            parent = block_hash
            if block_id in self._state_due:
                self._state_due.discard(block_id)
                self._announce_state(block_id)
            for copy in self._waiting.pop(block_id, {}):
                del self._waits_on[copy]
                self._announce_copy(copy, event)

    def reused(self, block_ids: list[int]) -> None:
        """``block_ids`` were handed out again: those still announced are gone, and
        no waiting tier copy will ever match them."""
        for block_id in block_ids:
            for copy in self._waiting.pop(block_id, {}):
                del self._waits_on[copy]
            self._state_due.discard(block_id)
            announced = self.announced.pop(block_id, None)
            if announced is not None:
                removed = BlockRemoved(block_hashes=announced.event.block_hashes,
                                       medium=MEDIUM_GPU)
                gone = block_id in self._windows_removed
                self._windows_removed.discard(block_id)
                self._emit(removed, windows=False if gone else None)
                if block_id in self.state_announced:
                    self.state_announced.discard(block_id)
                    self._emit(removed, state=True)

    def window_removed(self, block_id: int) -> None:
        """Device block ``block_id`` left the sliding-window groups (their pages were freed
        once out of every window: ``WindowPages``) and stays in the others: removed there.
        Not announced, or removed there already: nothing."""
        announced = self.announced.get(block_id)
        if announced is not None and block_id not in self._windows_removed:
            self._windows_removed.add(block_id)
            self._emit(BlockRemoved(block_hashes=announced.event.block_hashes,
                                    medium=MEDIUM_GPU), windows=True)

    def adopted(self, old: int, new: int) -> None:
        """The tree lists device block ``new`` instead of ``old`` for the same tokens
        (``old`` had lost its sliding-window pages, ``new`` has them): ``old``'s
        announcement moves to ``new``, in the sliding-window groups again."""
        announced = self.announced.pop(old, None)
        if announced is None or new in self.announced:
            return
        self.announced[new] = announced
        if old in self._windows_removed:
            self._windows_removed.discard(old)
            self._emit(announced.event, windows=True)

    def state_written(self, block_id: int) -> None:
        """Device block ``block_id``'s state page holds a state checkpoint (a step ends
        on its last token, or the next step copies one into it): announced in the state
        groups now, or once the block is announced. Announced already: nothing."""
        if block_id in self.state_announced:
            return
        if block_id in self.announced:
            self._announce_state(block_id)
        else:
            self._state_due.add(block_id)

    def state_removed(self, block_id: int) -> None:
        """Device block ``block_id``'s state pages no longer hold a checkpoint (freed:
        ``StatePages``): removed in the state groups, or no longer due there."""
        self._state_due.discard(block_id)
        if block_id in self.state_announced:
            self.state_announced.discard(block_id)
            self._emit(BlockRemoved(block_hashes=self.announced[block_id].event.block_hashes,
                                    medium=MEDIUM_GPU), state=True)

    def cleared(self) -> None:
        """Every device block left the cache (``reset_prefix_cache``). vLLM's
        ``AllBlocksCleared`` names no medium, so the tier copies still held are
        announced again after it."""
        self.announced.clear()
        self._windows_removed.clear()
        self.state_announced.clear()
        self._state_due.clear()
        self._events.append(AllBlocksCleared())
        for copy in self.tier_copies.values():
            self._emit(copy)

    # ----------------------------------------------------------------- tiers
    def tier_stored(self, tier: Tier, key: str, block_id: int) -> None:
        """``tier`` now holds (or is being sent) device block ``block_id``'s KV under
        ``key``; announced with the device block's hash, now or once the device
        block is announced. Announced already: nothing."""
        copy = (tier, key)
        if copy in self.tier_copies or copy in self._waits_on:
            return
        announced = self.announced.get(block_id)
        if announced is not None:
            self._announce_copy(copy, announced.event)
        else:
            self._wait(copy, block_id)

    def tier_copied(self, source: Tier, tier: Tier, key: str) -> None:
        """``tier`` now holds (or is being sent) a copy of ``source``'s block ``key``
        (a disk-to-host prefetch, for a block perhaps not on the device): announced as
        ``source``'s copy is, now or once its device block is. Nothing when ``source``'s
        copy is not announced (another process wrote it and no load here read it)."""
        copy = (tier, key)
        if copy in self.tier_copies or copy in self._waits_on:
            return
        announced = self.tier_copies.get((source, key))
        if announced is not None:
            self._announce_copy(copy, announced)
        elif (source, key) in self._waits_on:
            self._wait(copy, self._waits_on[(source, key)])

    def tier_removed(self, tier: Tier, key: str) -> None:
        """``tier`` no longer holds ``key`` (or is known not to). Not announced: nothing."""
        copy = (tier, key)
        block_id = self._waits_on.pop(copy, None)
        if block_id is not None:
            waiting = self._waiting[block_id]
            del waiting[copy]
            if not waiting:
                del self._waiting[block_id]
        event = self.tier_copies.pop(copy, None)
        if event is not None:
            self._emit(BlockRemoved(block_hashes=event.block_hashes, medium=tier.medium,
                                    locality=tier.locality))

    def tier_cleared(self, tier: Tier) -> None:
        """``tier`` dropped every key. O(copies, all tiers)."""
        keys = [k for t, k in [*self.tier_copies, *self._waits_on] if t == tier]
        for key in keys:
            self.tier_removed(tier, key)

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
            raise RuntimeError(f"tier copies {sorted(both)[:3]} both wait and are announced")
        if not self._windows_removed <= self.announced.keys():
            raise RuntimeError("a block is removed from the sliding-window groups but not "
                               "announced")
        if not self.state_announced <= self.announced.keys():
            raise RuntimeError("a state page is announced for a block that is not")
        if self._state_due & self.announced.keys():
            raise RuntimeError("a checkpoint waits for a block announced already")
        if (self.state_announced or self._state_due) and not any(
                g.holds_state for g in self.groups):
            raise RuntimeError("state pages tracked without a state group")
        for (tier, _key), event in self.tier_copies.items():
            if (event.medium, event.locality) != tier:
                raise RuntimeError(f"a copy in {tier} was announced as ({event.medium}, "
                                   f"{event.locality})")

    def _wait(self, copy: _Copy, block_id: int) -> None:
        """Announce ``copy`` once device block ``block_id`` is announced."""
        self._waiting.setdefault(block_id, {})[copy] = None
        self._waits_on[copy] = block_id

    def _announce_copy(self, copy: _Copy, event: BlockStored) -> None:
        tier = copy[0]
        announcement = msgspec.structs.replace(event, medium=tier.medium, locality=tier.locality)
        self.tier_copies[copy] = announcement
        self._emit(announcement)

    def _announce_state(self, block_id: int) -> None:
        self.state_announced.add(block_id)
        self._emit(self.announced[block_id].event, state=True)

    def _emit(self, event: BlockStored | BlockRemoved, state: bool = False,
              windows: bool | None = None) -> None:
        """``event`` (of a logical block) once per attention group, or per state group;
        ``windows`` True: in the sliding-window groups only, False: in the others only.
        O(groups)."""
        for index, group in enumerate(self.groups):
            if group.holds_state != state or (
                    windows is not None and windows != (group.sliding_window is not None)):
                continue
            if isinstance(event, BlockStored):
                self._events.append(msgspec.structs.replace(
                    event, group_idx=index, kv_cache_spec_kind=group.kind,
                    kv_cache_spec_sliding_window=group.sliding_window))
            else:
                self._events.append(msgspec.structs.replace(event, group_idx=index))

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
