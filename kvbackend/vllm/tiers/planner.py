"""The scheduler side of the host, disk and remote tiers, in plain Python: what moves each
step.

Inputs are what vLLM's scheduler knows (request ids, token ids, block ids and,
after each step, the blocks some rank failed to load); the output is one
``StepOrders`` per step for the workers. No vLLM import: tests drive it directly.

Every full block of a request has a chained key (``kvbackend.store.block_key``)
over its whole prefix, the request's namespace and ``key_digest`` (the cache
identity). Calls, in vLLM's order within a step:

  ``prefetch``          on a request's arrival, before it is scheduled: from its first
                        block, past the keys the mirror has, the next run of keys every
                        rank's disk holds, at most ``prefetch_step_blocks`` a step in
                        all, is inserted into the mirror (evicting only unpinned,
                        ordinary, not arriving keys, none of its own) and read from
                        disk into the host tiers after the step's saves
                        (``StepOrders.prefetches``). Blocks the device already holds
                        are not known here: they may be prefetched too. A prefetch
                        that fails on a rank leaves the mirror wrong: its later host hit
                        misses there, the worker reads the disk instead, and a failed
                        read is a failed load (recomputed, the key dropped by
                        ``step_finished``). A prefetch not yet sent is dropped when its
                        request finishes, when ``allocated`` adopts its key (the load
                        promotes it) or when a later insert evicts it.
  ``lookup``            at admission: from the end of the device hit, the longest run
                        of keys the workers' host tiers hold (``HostMirror``, LRU; a
                        key an earlier admission of this step promotes is not there
                        before the loads run, so it is not a host hit) or on disk on
                        every rank (a stat each: other processes' blocks count),
                        continued by the keys the remote tier holds for every rank
                        (one round trip per rank, at most ``remote_step_blocks`` per
                        step, less what this step's earlier admissions adopted: this
                        bounds the bytes a step fetches; during an outage none: a miss
                        at once, and only the lookup that finds the outage out waits, one
                        socket timeout, see ``RemoteTier``); capped at ``num_tokens - 1``.
                        A hit with remote blocks loads asynchronously (``loads_async``:
                        vLLM parks the request until the workers report its blocks
                        arrived), and so does every hit with ``all_loads_async`` (async
                        scheduling; several KV-cache groups: vLLM takes a failed load
                        only as a failed request, ``step_finished``). The host keys it
                        lists are pinned until the loads have run.
  ``allocated``         a load order per block vLLM adopted; a disk block is promoted
                        into the mirror when an unpinned slot can be made (a remote
                        block is not: it arrives steps later; its request's first
                        saves put it in host memory). A request with remote blocks is
                        listed in the step's ``async_loads``.
  ``plan_step``         a save order per block completed in this step, and per block of
                        a newly admitted request (but for a block some KV-cache group no
                        longer holds: a sliding window left it, its ``physical`` has a
                        0; never saved): to host unless the mirror has it (then
                        touched), to disk and to the remote tier for every block the
                        request loaded or computed (the workers skip files that exist and
                        keys the server holds; nothing here remembers either, which other
                        processes and the workers evict). A request
                        whose loads run in this step saves nothing before the next step:
                        its KV is known good only once every rank has loaded its blocks.
                        Mirror evictions become drop orders.
  ``step_finished``     blocks some rank failed to load (vLLM reports the union over
                        ranks): their keys leave the mirror and every worker drops them;
                        vLLM recomputes from the first failed block of each request, and
                        that request's saves, deferred so far, carry the recomputed blocks.
                        Asynchronous requests whose load failed as a whole (several
                        groups): every host key they loaded leaves the mirror (which
                        block failed is not known; vLLM recomputes the whole request,
                        whose retry must not hit the same missing key). A step that
                        reports nothing succeeded.
  ``request_finished``  forgets the request; with ``retain_s`` (its ``kv_retain_s``) the
                        host keys of its context stay behind every ordinary host key
                        that long (``HostMirror.retain``, at most ``max_retained``
                        keys; a retention ends at the first ``plan_step`` or
                        ``request_finished`` after its time).
  ``reset``             after a weight update: a new key epoch, the host tiers cleared,
                        the disk and remote tiers off for the rest of the process.
  ``take_tier_facts``   what the calls above learned of disk and remote keys (held:
                        loaded from there; gone: a probe missed, a load failed), for
                        KV events; the connector drains it every step.

State checkpoints (``state_groups``: a Mamba / linear-attention hybrid in vLLM's
"align" mode, ``kvbackend/vllm/state_checkpoints.py``): a block's state pages hold
the state after exactly its last token only if a step of the request that computed
it ended there. ``plan_step`` records those step ends; such a block is saved twice:
under its key, as every block is (an ordinary copy: its attention pages only, no one
reads a state from it), and under ``checkpoint_key(key)`` (every page; the host mirror
weighs it ``payload_weights[1]``, an ordinary copy ``payload_weights[0]``). A
lookup's hit is cut back to its longest prefix whose last block has a checkpoint copy
in some tier (host, else disk, else remote within the step's remote loads: one round
trip per rank asks for every copy past the longest one held locally), and that block
loads from it, state pages included; the hit's other blocks load their ordinary
copies' attention pages (their state pages stay 0 in the load order's ``physical``).
The workers then resume the request from that state, as from
a device hit's. A prefetch also queues the checkpoint copy its run would end on, and
a retention keeps each block's checkpoint copy with it. Checkpoint copies are not
announced as KV events (their blocks are).

Steps in flight: under vLLM's async scheduling step N+1 is planned before step N's
failures are reported, so the loads of the last ``max_steps_in_flight`` planned
steps are kept, oldest first; a report matches the failed block ids against all of
them (a block id that two of them load is dropped under both keys: a drop is always
safe) and retires the oldest. A step whose output carries nothing for the connector
is never reported: planning a step beyond ``max_steps_in_flight`` retires it.
With ``all_loads_async`` (async scheduling) every hit loads asynchronously: vLLM
parks the request until its load step's output, failures included, is in, so no
step computes on a load not yet known good (see ``kvbackend/vllm/manager.py``).
With several KV-cache groups every hit loads asynchronously too (vLLM then takes a
failed load only as a failed request). ``async_loads`` report their failures with
their request's finish report, possibly steps later, so their loads are kept
(``_awaited``) until that report.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvbackend.store import checkpoint_key, compute_block_keys
from kvbackend.vllm.tiers.host_mirror import HostMirror
from kvbackend.vllm.tiers.messages import (
    LoadOrder, SaveOrder, ScheduledRequest, Source, StepOrders, TierFact,
)

logger = logging.getLogger("kvbackend.tiers")


@dataclass(slots=True)
class _Lookup:
    """A lookup's hit, kept from ``lookup`` until the request's ``allocated``."""

    start: int  # first hit block: the device hit, in blocks
    keys: list[str]  # one per hit block: what its load reads
    sources: list[Source]  # one per hit block
    pinned: list[str]  # its host keys, pinned in the mirror


@dataclass(slots=True)
class _Loads:
    """One request's load orders of one step."""

    blocks: dict[int, str] = field(default_factory=dict)  # block id -> key, in load order
    pinned: list[str] = field(default_factory=list)  # host keys, pinned until sent


@dataclass(slots=True)
class _Request:
    tokens: Sequence[int]  # live: vLLM appends the output to this list
    namespace: bytes
    keys: list[str] = field(default_factory=list)  # chained keys of its full blocks, in order
    num_checked: int = 0  # blocks [0, num_checked) were considered for saving
    disk_from: int = 0  # blocks below it (the device hit at admission) are not saved to disk
    lookup: _Lookup | None = None
    sources: dict[Source, int] = field(default_factory=dict)  # tokens per tier, last load
    load_async: bool = False  # its last lookup's hit has remote blocks
    # hybrids: blocks (not yet considered for saving) on whose last token a step ended
    state_ends: set[int] = field(default_factory=set)


class TierPlanner:
    """Plans each step's loads, saves and drops (see the module docstring).

    ``disk_contains(key)``: whether every rank's disk tier holds ``key`` (None: no
    disk tier). ``remote_contains(keys)``: whether the remote tier holds each of ``keys``
    for every rank, in one round trip per rank (None: no remote tier);
    ``remote_step_blocks``: the most blocks one step loads from it;
    ``prefetch_step_blocks``: the most blocks one step prefetches from disk into host
    (0: no prefetch). ``host_capacity``: what each worker's host tier holds, at most
    ``max_retained`` of it retained, in units of which a block's copy takes
    ``payload_weights`` (ordinary, checkpoint; a hybrid's ordinary copies hold its
    attention pages only); ``clock`` (seconds) times retentions.
    ``max_steps_in_flight``: steps planned before the oldest one's output is in (vLLM's
    ``max_concurrent_batches``: 2 with async scheduling);
    ``all_loads_async``: every hit loads asynchronously (async scheduling, several
    KV-cache groups: see ``lookup`` in the module docstring). ``state_groups``: the
    positions, in a block's ``physical`` tuple, of a Mamba / linear-attention hybrid's
    state groups ("State checkpoints" in the module docstring).

    Invariants (``check_invariants``):
      * the mirror's own (``HostMirror.check_invariants``);
      * a key is pinned exactly as often as pending lookups and this step's loads
        list it as a host block, and the workers hold every such key (no key leaves
        the mirror while a request still lists it, and none is a host hit before
        the loads that bring it in have run);
      * a request never considered more blocks for saving than it has keys;
      * once the disk is off (``reset``), no disk or remote lookup happens;
      * this step's remote loads stay within ``remote_step_blocks``;
      * the queued prefetches, at most ``prefetch_step_blocks``, are arriving, unpinned
        mirror keys of known requests, and only while the disk is on;
      * a request listed for an asynchronous load had a remote hit in its lookup, or
        every load is asynchronous; the loads awaited are those of known requests;
      * step ends are recorded only with state groups, and every pending lookup of a
        hybrid ends on a checkpoint key.
    """

    def __init__(self, block_size: int, key_digest: str, host_capacity: int,
                 disk_contains: Callable[[str], bool] | None,
                 remote_contains: Callable[[list[str]], list[bool]] | None = None,
                 remote_step_blocks: int = 0, max_retained: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 prefetch_step_blocks: int = 0, max_steps_in_flight: int = 1,
                 all_loads_async: bool = False, state_groups: Collection[int] = (),
                 payload_weights: tuple[int, int] = (1, 1), draft_lookahead: int = 0) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(max_steps_in_flight, int) or max_steps_in_flight <= 0:
            raise ValueError(f"max_steps_in_flight must be a positive int, "
                             f"got {max_steps_in_flight!r}")
        self.block_size = block_size
        self.base_digest = self.key_digest = key_digest
        self.epoch = 0
        self.host = HostMirror(host_capacity, max_retained)
        self.clock = clock
        self.disk_contains = disk_contains
        self.remote_contains = remote_contains
        self.remote_step_blocks = remote_step_blocks
        self.prefetch_step_blocks = prefetch_step_blocks
        self.payload_weights = payload_weights
        self.draft_lookahead = draft_lookahead  # an EAGLE / MTP drafter's: see ``lookup``
        # key -> (request, whether a checkpoint copy), queued for this step
        self._prefetches: dict[str, tuple[str, bool]] = {}
        self._step_remote = 0  # remote loads planned for the step being scheduled
        self._requests: dict[str, _Request] = {}
        self._step_loads: dict[str, _Loads] = {}  # planned for the step being scheduled
        self.all_loads_async = all_loads_async
        self.state_groups = frozenset(state_groups)
        # Per step sent and not known finished, oldest first: request -> its loads.
        self._in_flight: deque[dict[str, _Loads]] = deque(maxlen=max_steps_in_flight)
        self._loads: list[LoadOrder] = []
        self._failed: list[tuple[str, int]] = []  # (request, block id) to fail unloaded
        self._async: dict[str, None] = {}  # requests admitted with an asynchronous load
        self._awaited: dict[str, _Loads] = {}  # async loads sent, until their report
        self._drops: list[str] = []
        self._clear_host = self._disk_off = False
        self._facts: list[TierFact] = []  # disk / remote keys seen held or missing, in order

    # ------------------------------------------------------------ scheduler calls
    def prefetch(self, request_id: str, tokens: Sequence[int], namespace: bytes) -> int:
        """Queue disk-to-host reads of the arriving request's blocks (see the module
        docstring); returns how many. O(new tokens) to compute its keys, plus O(1) per
        block the mirror has and a stat per rank per block probed on disk."""
        room = self.prefetch_step_blocks - len(self._prefetches)
        if room <= 0 or self.disk_contains is None or not self.host.capacity:
            return 0
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request(tokens, namespace)
        keys = self._keys(st, (len(tokens) - 1) // self.block_size)
        own = [key for key in keys if self.host.holds(key)]
        for key in own:  # its own blocks in host are no victims of its prefetch
            self.host.pin(key)
        queued = run = 0  # run: blocks from the first the host holds or will hold
        try:
            for key in keys:
                if key not in self.host:  # else held, or arriving with this step's orders
                    if queued == room or not self._on_disk(key) or not self._host_insert(
                            key, ordinary_only=True):
                        break
                    self._prefetches[key] = (request_id, False)
                    queued += 1
                run += 1
            if self.state_groups and queued < room:
                queued += self._prefetch_checkpoint(request_id, keys[:run])
        finally:
            self._unpin(own)
        return queued

    def lookup(self, request_id: str, tokens: Sequence[int], namespace: bytes,
               num_computed_tokens: int) -> int:
        """Tokens the tiers can supply right after a device hit of ``num_computed_tokens``
        (0 unless that is block-aligned; with an EAGLE / MTP drafter, less the run's last
        block). ``tokens`` is the request's live token list.
        O(new tokens) to extend its keys, plus O(1) per hit block and a stat per rank
        per disk block probed."""
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request(tokens, namespace)
        self._end_lookup(st)
        bs = self.block_size
        st.num_checked, st.disk_from = 0, num_computed_tokens // bs  # (re)admission
        st.load_async = False
        start, limit = num_computed_tokens // bs, (len(tokens) - 1) // bs
        if num_computed_tokens % bs or start >= limit:
            return 0
        st.state_ends.clear()
        sources: list[Source] = []
        for key in self._keys(st, limit)[start:]:
            if self.host.holds(key):
                sources.append(Source.HOST)
            elif self.disk_contains is not None and self._on_disk(key):
                sources.append(Source.DISK)
            else:
                break
        end = start + len(sources)
        room = self.remote_step_blocks - self._step_remote
        if self.remote_contains is not None and end < limit and room > 0:
            probed = st.keys[end:min(limit, end + room)]
            held = self.remote_contains(probed)
            found = held.index(False) if False in held else len(held)
            sources += [Source.REMOTE] * found
            if found < len(probed):
                self._facts.append(TierFact(Source.REMOTE, probed[found], None))
        if self.draft_lookahead:  # the drafter KV at the hit's end read its writer's next
            # tokens, which no key vouches for: as vLLM, the hit's last block is recomputed
            del sources[max(0, len(sources) - (self.draft_lookahead + bs - 1) // bs):]
        keys = st.keys[start:start + len(sources)]
        if self.state_groups:  # the hit ends on a checkpoint: its last block loads that
            keys, sources = self._checkpoint_hit(keys, sources)
        if not sources:
            return 0
        pinned = [k for k, s in zip(keys, sources) if s is Source.HOST]
        for key in pinned:
            self.host.pin(key)
        st.lookup = _Lookup(start, keys, sources, pinned)
        st.load_async = self.all_loads_async or Source.REMOTE in sources
        return len(sources) * bs

    def loads_async(self, request_id: str) -> bool:
        """Whether the request's last lookup offered remote blocks (or every load is
        asynchronous): vLLM then loads its hit asynchronously (the request waits; the
        others' steps go on). O(1)."""
        st = self._requests.get(request_id)
        return st is not None and st.load_async

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                  physical: Sequence[tuple[int, ...]] = ()) -> None:
        """vLLM admitted the request with the block table ``block_ids`` (and, with several
        KV-cache groups, ``physical``: ``ScheduledRequest``) and adopted
        ``num_external_tokens`` of its last lookup's hit: a load order per block.
        Adopting more than that lookup offered is a bug: the request's blocks are
        then reported as failed loads, and vLLM recomputes them. O(adopted blocks)."""
        st = self._requests.get(request_id)
        lookup = st.lookup if st is not None else None
        if st is not None:
            st.lookup, st.sources = None, {}
            if st.load_async and num_external_tokens > 0:  # vLLM awaits its report
                self._async[request_id] = None
        count = num_external_tokens // self.block_size
        if count > 0 and (lookup is None or count > len(lookup.sources) or (
                self.state_groups and count != len(lookup.sources))):
            logger.error("kvbackend tiers: request %s adopted %d tier tokens that its lookup "
                         "did not offer (or, with state layers, that do not end on its "
                         "checkpoint); this indicates a bug", request_id, num_external_tokens)
            self.fail_loads(request_id, block_ids)
            count = 0
        loads = _Loads()
        for j in range(count):
            i = lookup.start + j
            key, block_id = lookup.keys[j], block_ids[i]
            checkpoint = bool(self.state_groups) and j == count - 1
            blocks = physical[i] if physical else ()
            if self.state_groups and not checkpoint:  # attention KV only
                blocks = tuple(0 if g in self.state_groups else b for g, b in enumerate(blocks))
            if lookup.sources[j] is Source.HOST:
                self.host.touch(key)
                self.host.pin(key)
                loads.pinned.append(key)
                promote = False
            elif lookup.sources[j] is Source.REMOTE:
                promote = False
                self._step_remote += 1
            else:  # the load promotes a prefetch of this step instead of reading twice
                promote = self._prefetches.pop(key, None) is not None or self._host_insert(
                    key, checkpoint=checkpoint)
            self._loads.append(LoadOrder(request_id, block_id, key, promote, blocks, checkpoint))
            if lookup.sources[j] is not Source.HOST and not checkpoint:
                self._facts.append(TierFact(lookup.sources[j], key, block_id))
            loads.blocks[block_id] = key
            st.sources[lookup.sources[j]] = st.sources.get(lookup.sources[j], 0) + self.block_size
        if lookup is not None:
            self._unpin(lookup.pinned)
        if count > 0:
            previous = self._step_loads.pop(request_id, None)
            if previous is not None:
                self._unpin(previous.pinned)
            self._step_loads[request_id] = loads

    def fail_loads(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Have every worker report ``block_ids`` as failed loads (vLLM then recomputes
        the request from its first block): the safe answer to tokens vLLM adopted
        that no load order will fill. Its saves wait for the next step, as after any
        load. O(blocks)."""
        st = self._requests.get(request_id)
        if st is not None:
            self._end_lookup(st)
            st.sources = {}
            if st.load_async and block_ids:
                self._async[request_id] = None
        self._failed.extend((request_id, block_id) for block_id in block_ids)
        self._step_loads.setdefault(request_id, _Loads())

    def hit_sources(self, request_id: str, num_external_tokens: int) -> dict[Source, int]:
        """Tokens per tier of the request's last load, if they add up to
        ``num_external_tokens`` (else empty). O(1)."""
        st = self._requests.get(request_id)
        sources = dict(st.sources) if st is not None else {}
        return sources if sum(sources.values()) == num_external_tokens else {}

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepOrders:
        """The orders of the step being scheduled. O(scheduled requests + blocks to
        consider), plus O(new tokens) to extend keys, and O(log n) per retention that
        ends."""
        self.host.expire(self.clock())
        saves: list[SaveOrder] = []
        for request in scheduled:
            st = self._requests.get(request.request_id)
            end = request.num_computed_tokens + request.num_scheduled_tokens
            if st is not None and self.state_groups and end > 0:
                # the step leaves its state in the block of its last token: a checkpoint
                # when it ends on that block's boundary, else no longer one (a recompute
                # after a failed load, a preemption, may end inside a block recorded
                # before, whose saves were deferred)
                last = (end - 1) // self.block_size
                if end % self.block_size == 0:
                    st.state_ends.add(last)
                else:
                    st.state_ends.discard(last)
            if st is not None and request.request_id not in self._step_loads:
                self._plan_saves(request, st, saves)
        for st in self._requests.values():  # lookups whose allocation failed
            self._end_lookup(st)
        loads = self._loads
        if self.host.capacity:  # no put of a key that a later insert of this step evicted
            loads = [o._replace(promote=o.promote and o.key in self.host) for o in loads]
            saves = [o._replace(to_host=o.to_host and o.key in self.host) for o in saves
                     if o.to_disk or o.key in self.host]
        for step_loads in self._step_loads.values():
            self._unpin(step_loads.pinned)  # loaded in this step, before any later drop
            step_loads.pinned = []
        prefetches = tuple((key, checkpoint) for key, (_, checkpoint)
                           in self._prefetches.items())
        for request_id in self._async:  # unpinned above
            self._awaited[request_id] = self._step_loads.get(request_id, _Loads())
        orders = StepOrders(self._clear_host, self._disk_off, tuple(self._drops), tuple(loads),
                            tuple(self._failed), tuple(saves), tuple(self._async), prefetches)
        self._prefetches.clear()
        self._in_flight.append(self._step_loads)  # retires the oldest beyond the bound
        self._step_loads = {}
        self._loads, self._failed, self._drops, self._async = [], [], [], {}
        self._clear_host = self._disk_off = False
        self._step_remote = 0
        self.host.orders_sent()
        return orders

    def step_finished(self, failed_block_ids: Collection[int],
                      finished_requests: Collection[str] = (),
                      failed_requests: Collection[str] = ()) -> None:
        """The oldest step in flight ran; ``failed_block_ids`` failed to load on at least
        one rank (matched against every step in flight: see the module docstring); the
        asynchronous loads of ``finished_requests`` ended, those of ``failed_requests``
        (among them) failed as a whole. O(loads of the steps in flight and of the
        requests reported)."""
        in_flight = [item for step in self._in_flight for item in step.items()]
        if self._in_flight:
            self._in_flight.popleft()
        awaited = [(r, self._awaited.pop(r)) for r in finished_requests if r in self._awaited]
        if not (failed_block_ids or failed_requests):
            return
        failed = set(failed_block_ids)
        bad: dict[str, set[str]] = {}  # request -> its keys that failed to load
        for request_id, loads in [*in_flight, *awaited]:
            whole = request_id in failed_requests
            bad.setdefault(request_id, set()).update(
                key for block_id, key in loads.blocks.items() if whole or block_id in failed)
        for request_id, keys in bad.items():
            for key in keys:  # gone or corrupt on some rank; a rank that loaded it drops it
                if self.host.remove(key):
                    self._drops.append(key)
                if request_id not in failed_requests:  # a failed request names no key
                    self._facts += [TierFact(Source.DISK, key, None),
                                    TierFact(Source.REMOTE, key, None)]
            if request_id in failed_requests:
                logger.warning("kvbackend tiers: request %s: its tier hit failed to load; the "
                               "request is recomputed", request_id)
            elif keys:
                logger.warning("kvbackend tiers: request %s: %d block(s) failed to load from "
                               "host/disk; they are recomputed", request_id, len(keys))

    def take_tier_facts(self) -> list[TierFact]:
        """What lookups, prefetches, loads and failed loads learned of disk and remote
        keys since the last call, in order (``TierFact``). O(1)."""
        facts, self._facts = self._facts, []
        return facts

    def pending_host_changes(self) -> tuple[bool, tuple[str, ...]]:
        """What the next orders tell every worker before anything else: whether to clear
        its host tier, and the keys to drop from it. O(drops)."""
        return self._clear_host, tuple(self._drops)

    def request_finished(self, request_id: str, retain_s: float = 0.0) -> None:
        """Forget the request; keep its context's host keys ahead of ordinary ones for
        ``retain_s`` seconds. O(1), plus O(blocks log n) to retain them and O(log n)
        per retention that ends."""
        now = self.clock()
        self.host.expire(now)
        st = self._requests.pop(request_id, None)
        self._awaited.pop(request_id, None)
        for key in [k for k, (r, _) in self._prefetches.items() if r == request_id]:
            del self._prefetches[key]  # arriving: no worker holds it, nothing to drop
            self.host.remove(key)
        if st is not None:
            self._end_lookup(st)
            if retain_s > 0:
                self.host.retain(self._context_keys(st), now + retain_s)

    def reset(self) -> None:
        """After a weight update (``reset_prefix_cache(reset_connector=True)``): nothing
        computed before may be served again. Keys move to a new epoch, so no earlier
        key ever matches; every worker clears its host tier; the disk tier is off for
        the rest of the process, because its files are named by the weight *files*,
        which no longer describe the weights in memory; requests already known are
        never saved. O(requests + host keys)."""
        self.epoch += 1
        self.key_digest = hashlib.sha256(
            f"{self.base_digest}/epoch/{self.epoch}".encode()).hexdigest()
        if self.disk_contains is not None or self.remote_contains is not None:
            self.disk_contains = self.remote_contains = None
            self._disk_off = True
        self.forget_host()
        self._requests.clear()
        self._in_flight.clear()
        self._awaited.clear()

    def forget_host(self) -> None:
        """Forget the host tier; every worker clears its own with the next orders.
        The way back to a known state after an error. O(host keys + requests)."""
        self.host.clear()
        self._prefetches.clear()
        self._drops.clear()
        self._clear_host = True
        for st in self._requests.values():
            st.lookup = None  # an adoption of it now fails its blocks: recomputed
        for loads in self._step_loads.values():
            loads.pinned = []

    # ------------------------------------------------------------------ helpers
    def _keys(self, st: _Request, num_blocks: int) -> list[str]:
        have, bs = len(st.keys), self.block_size
        if num_blocks > have:
            st.keys.extend(compute_block_keys(
                st.tokens[have * bs: num_blocks * bs], bs, self.key_digest, st.namespace,
                parent=st.keys[-1] if st.keys else None))
        return st.keys

    def _context_keys(self, st: _Request) -> list[str]:
        """The keys of the blocks ``st`` considered for saving, in order; a hybrid's each
        followed by its checkpoint key (held or not: a block this request loaded may
        hold a checkpoint another one saved). O(blocks)."""
        keys = st.keys[:st.num_checked]
        if not self.state_groups:
            return keys
        return [k for key in keys for k in (key, checkpoint_key(key))]

    def _on_disk(self, key: str) -> bool:
        """Whether every rank's disk holds ``key``; a miss is a ``TierFact``."""
        if self.disk_contains(key):
            return True
        self._facts.append(TierFact(Source.DISK, key, None))
        return False

    def _host_insert(self, key: str, ordinary_only: bool = False,
                     checkpoint: bool = False) -> bool:
        inserted = self.host.insert(key, ordinary_only, self.payload_weights[checkpoint])
        self._drops.extend(inserted.evicted)
        for evicted in inserted.evicted:  # a queued prefetch a later insert evicted
            self._prefetches.pop(evicted, None)
        return inserted.added

    def _plan_saves(self, request: ScheduledRequest, st: _Request,
                    saves: list[SaveOrder]) -> None:
        done = min(request.num_computed_tokens + request.num_scheduled_tokens, len(st.tokens))
        num_full = min(done // self.block_size, len(request.block_ids))
        if num_full <= st.num_checked:
            return
        keys = self._keys(st, num_full)
        disk_on, remote_on = self.disk_contains is not None, self.remote_contains is not None
        for i in range(st.num_checked, num_full):
            physical = request.physical[i] if request.physical else ()
            if any(b == 0 for g, b in enumerate(physical) if g not in self.state_groups):
                continue  # a sliding-window group no longer holds it: not whole
            to_host = self._host_insert(keys[i])
            to_disk = disk_on and i >= st.disk_from
            to_remote = remote_on and i >= st.disk_from
            if to_host or to_disk or to_remote:
                saves.append(SaveOrder(request.request_id, request.block_ids[i], keys[i],
                                       to_host, to_disk, to_remote, physical))
            if i in st.state_ends and 0 not in physical:  # and a copy whose state pages a
                st.state_ends.discard(i)  # hit resumes from (its step holds them)
                key = checkpoint_key(keys[i])
                saves.append(SaveOrder(request.request_id, request.block_ids[i], key,
                                       self._host_insert(key, checkpoint=True), to_disk,
                                       to_remote, physical, checkpoint=True))
        st.num_checked = num_full

    def _prefetch_checkpoint(self, request_id: str, keys: list[str]) -> int:
        """Queue the checkpoint copy a lookup of the run ``keys`` would end on (the last
        block's with one in host or on disk), if only the disk has it; returns 0 or 1.
        O(run) probes at most."""
        for key in map(checkpoint_key, reversed(keys)):
            if key in self.host:
                return 0
            if self.disk_contains(key):
                if not self._host_insert(key, ordinary_only=True, checkpoint=True):
                    return 0
                self._prefetches[key] = (request_id, True)
                return 1
        return 0

    def _checkpoint_hit(self, keys: list[str], sources: list[Source]
                        ) -> tuple[list[str], list[Source]]:
        """The longest prefix of a hit (``keys``, ``sources``) whose last block has a
        checkpoint copy in some tier, its last key that copy's (from the remote tier only
        within this step's remote loads). O(hit blocks) local probes, down to the longest
        prefix with a copy in host or on disk, and one remote round trip for the longer
        ones."""
        room = self.remote_step_blocks - self._step_remote - sources.count(Source.REMOTE)
        remote_ok = [] if self.remote_contains is None else [  # within the remote budget
            room > 0 or s is Source.REMOTE for s in sources]
        candidates: list[int] = []  # longer prefixes whose copy only the remote tier may hold
        n, source = len(keys), None
        while n:
            key = checkpoint_key(keys[n - 1])
            if self.host.holds(key):
                source = Source.HOST
                break
            if self.disk_contains is not None and self.disk_contains(key):
                source = Source.DISK
                break
            if remote_ok and remote_ok[n - 1]:
                candidates.append(n)
            n -= 1
        if candidates:
            held = self.remote_contains([checkpoint_key(keys[m - 1]) for m in candidates])
            if True in held:
                n, source = candidates[held.index(True)], Source.REMOTE
        if source is None:
            return [], []
        return [*keys[:n - 1], checkpoint_key(keys[n - 1])], [*sources[:n - 1], source]

    def _end_lookup(self, st: _Request) -> None:
        if st.lookup is not None:
            self._unpin(st.lookup.pinned)
            st.lookup = None

    def _unpin(self, keys: list[str]) -> None:
        for key in keys:
            self.host.unpin(key)

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant (plain raises, so
        ``python -O`` keeps them). O(requests + host keys + listed blocks)."""
        self.host.check_invariants()
        listed: Counter[str] = Counter()
        for st in self._requests.values():
            if st.lookup is not None:
                listed.update(st.lookup.pinned)
                if self.state_groups and st.lookup.keys[-1] != checkpoint_key(
                        st.keys[st.lookup.start + len(st.lookup.keys) - 1]):
                    raise RuntimeError("a hybrid's hit does not end on a checkpoint copy")
            if st.state_ends and not self.state_groups:
                raise RuntimeError("step ends recorded without state groups")
            if st.num_checked > len(st.keys):
                raise RuntimeError(f"{st.num_checked} blocks considered for saving, only "
                                   f"{len(st.keys)} keys")
        for loads in self._step_loads.values():
            listed.update(loads.pinned)
        pinned = {key: self.host.pin_count(key) for key in listed}
        if pinned != dict(listed):
            raise RuntimeError(f"pin counts {pinned} != listings {dict(listed)}")
        if self.host.num_pinned() != len(listed):
            raise RuntimeError("a key is pinned that nothing lists")
        lost = [key for key in listed if not self.host.holds(key)]
        if lost:
            raise RuntimeError(f"host hits {lost[:3]} are not in every worker's host tier")
        if self.epoch and self.disk_contains is not None:
            raise RuntimeError("disk in use after reset")
        if self.epoch and self.remote_contains is not None:
            raise RuntimeError("remote tier in use after reset")
        if not 0 <= self._step_remote <= self.remote_step_blocks:
            raise RuntimeError(f"{self._step_remote} remote loads planned, over "
                               f"{self.remote_step_blocks}")
        if len(self._prefetches) > self.prefetch_step_blocks:
            raise RuntimeError(f"{len(self._prefetches)} prefetches queued, over "
                               f"{self.prefetch_step_blocks}")
        if self._prefetches and self.disk_contains is None:
            raise RuntimeError("prefetches queued without a disk tier")
        for key, (request_id, _) in self._prefetches.items():
            if (key in listed or key not in self.host or self.host.holds(key)
                    or request_id not in self._requests):
                raise RuntimeError(f"prefetch of {key[:16]} for {request_id} is not an "
                                   "arriving, unpinned key of a known request")
        no_remote = [r for r in self._async
                     if r in self._requests and not self._requests[r].load_async]
        if no_remote:
            raise RuntimeError(f"requests {no_remote[:3]} load asynchronously without a "
                               "remote hit")
        unknown = [r for r in self._awaited if r not in self._requests]
        if unknown:
            raise RuntimeError(f"loads of finished requests {unknown[:3]} still awaited")


__all__ = ["TierPlanner"]
