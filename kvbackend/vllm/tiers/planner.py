"""The scheduler side of the host, disk and remote tiers, in plain Python: what moves each
step.

Inputs are what vLLM's scheduler knows (request ids, token ids, block ids and,
after each step, the blocks some rank failed to load); the output is one
``StepOrders`` per step for the workers. No vLLM import: tests drive it directly.

Every full block of a request has a chained key (``kvbackend.store.block_key``)
over its whole prefix, the request's namespace and ``key_digest`` (the cache
identity). Calls, in vLLM's order within a step:

  ``lookup``            at admission: from the end of the device hit, the longest run
                        of keys the workers' host tiers hold (``HostMirror``, LRU; a
                        key an earlier admission of this step promotes is not there
                        before the loads run, so it is not a host hit) or on disk on
                        every rank (a stat each: other processes' blocks count),
                        continued by the keys the remote tier holds for every rank
                        (one round trip per rank, at most ``remote_step_blocks`` per
                        step, less what this step's earlier admissions adopted: remote
                        loads are synchronous, and this bounds the time they add to a
                        step); capped at ``num_tokens - 1``. The host keys it lists are pinned until
                        the loads have run.
  ``allocated``         a load order per block vLLM adopted; a disk or remote block is
                        promoted into the mirror when an unpinned slot can be made.
  ``plan_step``         a save order per block completed in this step, and per block of
                        a newly admitted request: to host unless the mirror has it (then
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
                        A step that reports nothing succeeded.
  ``request_finished``  forgets the request.
  ``reset``             after a weight update: a new key epoch, the host tiers cleared,
                        the disk and remote tiers off for the rest of the process.

The planner assumes vLLM's synchronous scheduling (kvbackend refuses async
scheduling): a step's orders have run, and its failures are reported, before the
next step is planned.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvbackend.store import compute_block_keys
from kvbackend.vllm.tiers.host_mirror import HostMirror
from kvbackend.vllm.tiers.messages import (
    LoadOrder, SaveOrder, ScheduledRequest, Source, StepOrders,
)

logger = logging.getLogger("kvbackend.tiers")


@dataclass(slots=True)
class _Lookup:
    """A lookup's hit, kept from ``lookup`` until the request's ``allocated``."""

    start: int  # first hit block: the device hit, in blocks
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


class TierPlanner:
    """Plans each step's loads, saves and drops (see the module docstring).

    ``disk_contains(key)``: whether every rank's disk tier holds ``key`` (None: no
    disk tier). ``remote_contains(keys)``: how many leading ``keys`` the remote tier
    holds for every rank (None: no remote tier); ``remote_step_blocks``: the most
    blocks one step loads from it. ``host_capacity``: blocks each worker's host tier
    holds.

    Invariants (``check_invariants``):
      * the mirror's own (``HostMirror.check_invariants``);
      * a key is pinned exactly as often as pending lookups and this step's loads
        list it as a host block, and the workers hold every such key (no key leaves
        the mirror while a request still lists it, and none is a host hit before
        the loads that bring it in have run);
      * a request never considered more blocks for saving than it has keys;
      * once the disk is off (``reset``), no disk or remote lookup happens;
      * this step's remote loads stay within ``remote_step_blocks``.
    """

    def __init__(self, block_size: int, key_digest: str, host_capacity: int,
                 disk_contains: Callable[[str], bool] | None,
                 remote_contains: Callable[[list[str]], int] | None = None,
                 remote_step_blocks: int = 0) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.base_digest = self.key_digest = key_digest
        self.epoch = 0
        self.host = HostMirror(host_capacity)
        self.disk_contains = disk_contains
        self.remote_contains = remote_contains
        self.remote_step_blocks = remote_step_blocks
        self._step_remote = 0  # remote loads planned for the step being scheduled
        self._requests: dict[str, _Request] = {}
        self._step_loads: dict[str, _Loads] = {}  # planned for the step being scheduled
        self._in_flight: dict[str, _Loads] = {}  # sent with the last step, until it finished
        self._loads: list[LoadOrder] = []
        self._failed: list[int] = []
        self._drops: list[str] = []
        self._clear_host = self._disk_off = False

    # ------------------------------------------------------------ scheduler calls
    def lookup(self, request_id: str, tokens: Sequence[int], namespace: bytes,
               num_computed_tokens: int) -> int:
        """Tokens the tiers can supply right after a device hit of ``num_computed_tokens``
        (0 unless that is block-aligned). ``tokens`` is the request's live token list.
        O(new tokens) to extend its keys, plus O(1) per hit block and a stat per rank
        per disk block probed."""
        self._in_flight.clear()  # the last step finished without a failure report
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request(tokens, namespace)
        self._end_lookup(st)
        bs = self.block_size
        st.num_checked, st.disk_from = 0, num_computed_tokens // bs  # (re)admission
        start, limit = num_computed_tokens // bs, (len(tokens) - 1) // bs
        if num_computed_tokens % bs or start >= limit:
            return 0
        sources: list[Source] = []
        for key in self._keys(st, limit)[start:]:
            if self.host.holds(key):
                sources.append(Source.HOST)
            elif self.disk_contains is not None and self.disk_contains(key):
                sources.append(Source.DISK)
            else:
                break
        end = start + len(sources)
        room = self.remote_step_blocks - self._step_remote
        if self.remote_contains is not None and end < limit and room > 0:
            found = self.remote_contains(st.keys[end:min(limit, end + room)])
            sources += [Source.REMOTE] * found
        if not sources:
            return 0
        pinned = [k for k, s in zip(st.keys[start:], sources) if s is Source.HOST]
        for key in pinned:
            self.host.pin(key)
        st.lookup = _Lookup(start, sources, pinned)
        return len(sources) * bs

    def allocated(self, request_id: str, block_ids: Sequence[int],
                  num_external_tokens: int) -> None:
        """vLLM admitted the request with the block table ``block_ids`` and adopted
        ``num_external_tokens`` of its last lookup's hit: a load order per block.
        Adopting more than that lookup offered is a bug: the request's blocks are
        then reported as failed loads, and vLLM recomputes them. O(adopted blocks)."""
        self._in_flight.clear()
        st = self._requests.get(request_id)
        lookup = st.lookup if st is not None else None
        if st is not None:
            st.lookup, st.sources = None, {}
        count = num_external_tokens // self.block_size
        if count > 0 and (lookup is None or count > len(lookup.sources)):
            logger.error("kvbackend tiers: request %s adopted %d tier tokens that its lookup "
                         "did not offer; this indicates a bug", request_id, num_external_tokens)
            self.fail_loads(request_id, block_ids)
            count = 0
        loads = _Loads()
        for j in range(count):
            i = lookup.start + j
            key, block_id = st.keys[i], block_ids[i]
            if lookup.sources[j] is Source.HOST:
                self.host.touch(key)
                self.host.pin(key)
                loads.pinned.append(key)
                promote = False
            else:
                promote = self._host_insert(key)
                if lookup.sources[j] is Source.REMOTE:
                    self._step_remote += 1
            self._loads.append(LoadOrder(request_id, block_id, key, promote))
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
        self._failed.extend(block_ids)
        self._step_loads.setdefault(request_id, _Loads())

    def hit_sources(self, request_id: str, num_external_tokens: int) -> dict[Source, int]:
        """Tokens per tier of the request's last load, if they add up to
        ``num_external_tokens`` (else empty). O(1)."""
        st = self._requests.get(request_id)
        sources = dict(st.sources) if st is not None else {}
        return sources if sum(sources.values()) == num_external_tokens else {}

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepOrders:
        """The orders of the step being scheduled. O(scheduled requests + blocks to
        consider), plus O(new tokens) to extend keys."""
        self._in_flight.clear()
        saves: list[SaveOrder] = []
        for request in scheduled:
            st = self._requests.get(request.request_id)
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
        orders = StepOrders(self._clear_host, self._disk_off, tuple(self._drops), tuple(loads),
                            tuple(self._failed), tuple(saves))
        self._in_flight, self._step_loads = self._step_loads, {}
        self._loads, self._failed, self._drops = [], [], []
        self._clear_host = self._disk_off = False
        self._step_remote = 0
        self.host.orders_sent()
        return orders

    def step_finished(self, failed_block_ids: Collection[int]) -> None:
        """The last step ran; ``failed_block_ids`` failed to load on at least one rank.
        O(loads of that step)."""
        in_flight, self._in_flight = self._in_flight, {}
        if not failed_block_ids:
            return
        failed = set(failed_block_ids)
        for request_id, loads in in_flight.items():
            bad = [key for block_id, key in loads.blocks.items() if block_id in failed]
            for key in bad:  # gone or corrupt on some rank; a rank that loaded it drops it
                if self.host.remove(key):
                    self._drops.append(key)
            if bad:
                logger.warning("kvbackend tiers: request %s: %d block(s) failed to load from "
                               "host/disk; they are recomputed", request_id, len(bad))

    def pending_host_changes(self) -> tuple[bool, tuple[str, ...]]:
        """What the next orders tell every worker before anything else: whether to clear
        its host tier, and the keys to drop from it. O(drops)."""
        return self._clear_host, tuple(self._drops)

    def request_finished(self, request_id: str) -> None:
        """Forget the request. O(1)."""
        st = self._requests.pop(request_id, None)
        if st is not None:
            self._end_lookup(st)

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

    def forget_host(self) -> None:
        """Forget the host tier; every worker clears its own with the next orders.
        The way back to a known state after an error. O(host keys + requests)."""
        self.host.clear()
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

    def _host_insert(self, key: str) -> bool:
        inserted = self.host.insert(key)
        self._drops.extend(inserted.evicted)
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
            to_host = self._host_insert(keys[i])
            to_disk = disk_on and i >= st.disk_from
            to_remote = remote_on and i >= st.disk_from
            if to_host or to_disk or to_remote:
                saves.append(SaveOrder(request.request_id, request.block_ids[i], keys[i],
                                       to_host, to_disk, to_remote))
        st.num_checked = num_full

    def _end_lookup(self, st: _Request) -> None:
        if st.lookup is not None:
            self._unpin(st.lookup.pinned)
            st.lookup = None

    def _unpin(self, keys: list[str]) -> None:
        for key in keys:
            self.host.unpin(key)

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant. O(requests +
        host keys + listed blocks)."""
        self.host.check_invariants()
        listed: Counter[str] = Counter()
        for st in self._requests.values():
            if st.lookup is not None:
                listed.update(st.lookup.pinned)
            assert st.num_checked <= len(st.keys), (
                f"{st.num_checked} blocks considered for saving, only {len(st.keys)} keys")
        for loads in self._step_loads.values():
            listed.update(loads.pinned)
        pinned = {key: self.host.pin_count(key) for key in listed}
        assert pinned == dict(listed), f"pin counts {pinned} != listings {dict(listed)}"
        assert self.host.num_pinned() == len(listed), "a key is pinned that nothing lists"
        lost = [key for key in listed if not self.host.holds(key)]
        assert not lost, f"host hits {lost[:3]} are not in every worker's host tier"
        assert not (self.epoch and self.disk_contains is not None), "disk in use after reset"
        assert not (self.epoch and self.remote_contains is not None), (
            "remote tier in use after reset")
        assert 0 <= self._step_remote <= self.remote_step_blocks, (
            f"{self._step_remote} remote loads planned, over {self.remote_step_blocks}")


__all__ = ["TierPlanner"]
