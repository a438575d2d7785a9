"""The worker side of the host, disk and remote tiers: each step's ``StepOrders``, carried
out.

``TierWorker`` moves bytes through a ``kvbackend.ops.BlockMover``, a block (all
layers) at a time, without staging copies on a CPU cache:

  ``start_step``   before the forward pass (after it when the step loads nothing
                   synchronously): clear the host tier / stop using the disk and
                   remote tiers when told, apply the drops, then load each block
                   from host, else disk (read straight into its buffer and verified
                   there: checksum, identity, size), and scatter each into its block
                   of every layer. The blocks of ``async_loads`` requests that
                   neither had go to a ``RemoteReader`` (one round trip per request,
                   verified alike, on its own thread): the step does not wait.
  ``take_finished_loads``  the ``async_loads`` requests whose remote blocks arrived
                   (or missed) since the last call: their blocks are scattered now,
                   between steps, and the misses become load errors.
  ``finish_step``  after the forward pass, when the bytes are final: gather each saved
                   block straight into the array the host tier keeps and/or write it to
                   the disk tier (atomic, checksummed), unless its file already exists;
                   blocks for the remote tier are gathered into fresh arrays and handed
                   to a ``RemoteWriter``, which sends them from its own thread. Then
                   the prefetches: disk blocks read into the host tier.
  ``take_load_errors``  the blocks that missed or failed verification since the last
                   call; they were scattered nowhere. vLLM unions every rank's errors
                   and recomputes from each request's first failed block. With
                   ``fail_requests`` (several KV-cache groups, where vLLM takes no
                   failed block ids) a failed block fails its request instead, which
                   is then asynchronous: ``take_failed_requests``, and vLLM recomputes
                   it whole.
  ``take_stats``   bytes, seconds and verification failures per tier since the last
                   call, and the tiers' occupancy (``kvbackend.vllm.tiers.metrics``):
                   counted per step and tier, nothing per block.

Saves run here rather than in the next step: on the CPU there is no copy engine
to overlap with, and a block must be read before any later step can reuse it
(remote saves too: they are gathered here; only the network transfer is deferred).
Best effort: nothing here raises into vLLM; a failed save is a future miss and
a failed load is recomputed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from kvbackend.ops import BlockMover
from kvbackend.store.remote_reader import RemoteReader
from kvbackend.store.remote_writer import RemoteWriter
from kvbackend.vllm.tiers.messages import LoadOrder, StepOrders
from kvbackend.vllm.tiers.metrics import KVBackendStats

logger = logging.getLogger("kvbackend.tiers")


class TierWorker:
    """One worker's tiers and the orders it has carried out. Without a mover (the
    tiers could not be set up on this worker) every load fails and nothing is
    saved. ``remote``: the remote tier's writer (its ``tier`` serves the loads, through
    a ``RemoteReader``), or None. ``rank`` names this worker's gauges in the stats.
    ``fail_requests``: report failed loads per request (module docstring). Calls must
    not overlap.

    Invariant: every ``async_loads`` request is reported by ``take_finished_loads``
    exactly once (vLLM holds its blocks until then), after its blocks were
    scattered or reported as load errors (with ``fail_requests``: it is then in
    ``take_failed_requests``); ``fetching`` lists the ones still out."""

    def __init__(self, mover: BlockMover | None, remote: RemoteWriter | None = None,
                 rank: int = 0, fail_requests: bool = False) -> None:
        self.mover = mover
        self.remote = remote
        self.reader = RemoteReader(remote.tier) if remote is not None else None
        self.fetching: dict[str, list[LoadOrder]] = {}  # request -> its blocks being fetched
        self._finished: set[str] = set()  # async loads done, not reported yet
        self._remote_corrupt = 0  # the remote tier's corrupt count, last seen
        self.rank = str(rank)
        self._load_errors: set[int] = set()
        self.fail_requests = fail_requests
        self._failed_requests: set[str] = set()  # with fail_requests: until reported finished
        self._stats = KVBackendStats()
        self._moved = False  # since the last take_stats: the gauges may have changed

    def start_step(self, orders: StepOrders) -> None:
        """Clears, drops and loads, before the forward pass. O(drops + loaded bytes)."""
        mover = self.mover
        self._fail(orders.failed)
        if mover is None:
            self._fail((o.request_id, o.block_id) for o in orders.loads)
            self._finished.update(orders.async_loads)
            return
        try:
            if orders.clear_host and mover.host is not None:
                mover.host.evict_to(0)
            if orders.disk_off:
                mover.disk = None
                self.close()
            if mover.host is not None:
                for key in orders.drops:
                    mover.host.remove(key)
        except Exception:  # noqa: BLE001 - never fail the step for a cache
            logger.exception("kvbackend tiers: dropping host blocks failed")
        self._moved = self._moved or bool(orders.clear_host or orders.drops or orders.loads)
        try:
            missed = self._load_local(mover, orders.loads) if orders.loads else []
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: loading blocks failed; they are recomputed")
            missed = list(orders.loads)
        background = set(orders.async_loads)
        self._fail((o.request_id, o.block_id) for o in missed if o.request_id not in background)
        for request_id in orders.async_loads:
            self._fetch(request_id, [o for o in missed if o.request_id == request_id])

    def _fetch(self, request_id: str, loads: list[LoadOrder]) -> None:
        """Have the reader fetch ``loads`` of one async request (none: done already)."""
        if not loads or self.reader is None or self.remote is None:
            self._fail((o.request_id, o.block_id) for o in loads)
            self._finished.add(request_id)
            return
        self.fetching[request_id] = loads
        self.reader.submit(request_id, [o.key for o in loads])

    def take_finished_loads(self) -> set[str]:
        """The async requests whose blocks are in place (or reported as load errors)
        since the last call; scatters the blocks fetched meanwhile. Never waits.
        O(fetched bytes)."""
        done = self.reader.take_done() if self.reader is not None else []
        for request_id, payloads, seconds in done:
            loads = self.fetching.pop(request_id, [])
            found = [(o, p) for o, p in zip(loads, payloads)
                     if p is not None and self.remote is not None]  # none once closed
            try:
                ok = self.mover.load_payloads(
                    [(o.blocks, o.key, p, o.promote, o.checkpoint) for o, p in found])
            except Exception:  # noqa: BLE001
                logger.exception("kvbackend tiers: placing remote blocks failed; they are "
                                 "recomputed")
                ok = [False] * len(found)
            placed = [o for (o, _), good in zip(found, ok) if good]
            held = {o.blocks for o in placed}
            self._fail((o.request_id, o.block_id) for o in loads if o.blocks not in held)
            self._loaded("remote", self._nbytes(o.checkpoint for o in placed), seconds)
            self._finished.add(request_id)
            self._moved = True
        if done and self.reader is not None:
            corrupt = _corrupt_count(self.reader.tier)
            self._stats.count("verify_failed_blocks", "remote", corrupt - self._remote_corrupt)
            self._remote_corrupt = corrupt
        finished, self._finished = self._finished, set()
        return finished

    def _load_local(self, mover: BlockMover, loads: Sequence[LoadOrder]) -> list[LoadOrder]:
        """Load the blocks host holds, then the rest from disk, each tier timed; returns
        those neither had."""
        host = mover.host
        in_host: list[LoadOrder] = []
        rest: list[LoadOrder] = []
        for order in loads:
            (in_host if host is not None and host.contains(order.key) else rest).append(order)
        if mover.disk is None:
            missed, rest = rest, []
        else:
            missed = []
        for tier, part in (("host", in_host), ("disk", rest)):
            if part:
                corrupt = _corrupt_count(mover.disk) if tier == "disk" else 0
                start = time.perf_counter()
                done = mover.load_many([(o.blocks, o.key, o.promote, o.checkpoint)
                                        for o in part])
                self._loaded(tier, self._nbytes(o.checkpoint for o, ok in zip(part, done) if ok),
                             time.perf_counter() - start)
                if tier == "disk":
                    self._stats.count("verify_failed_blocks", tier,
                                      _corrupt_count(mover.disk) - corrupt)
                missed += [o for o, ok in zip(part, done) if not ok]
        return missed

    def _loaded(self, tier: str, nbytes: int, seconds: float) -> None:
        self._stats.count("load_bytes", tier, nbytes)
        self._stats.observe("load_seconds", tier, seconds)

    def _nbytes(self, checkpoints: Iterable[bool]) -> int:
        """The payload bytes of blocks that are (or are not) checkpoint copies."""
        return sum(map(self.mover.payload_nbytes, checkpoints))

    def finish_step(self, orders: StepOrders) -> None:
        """The saves, then the prefetches, after the forward pass. O(saved and prefetched
        bytes) plus a stat per disk save."""
        mover = self.mover
        if mover is None:
            return
        if orders.saves:
            self._save(mover, orders)
        if orders.prefetches:
            self._prefetch(mover, orders.prefetches)

    def _save(self, mover: BlockMover, orders: StepOrders) -> None:
        self._moved = True
        # Per tier: bytes saved; blocks timed and their seconds (a block saved to host
        # and disk is timed as disk: one gather serves both).
        saved = {"host": 0, "disk": 0, "remote": 0}
        timed = {"host": 0, "disk": 0, "remote": 0}
        seconds = {"host": 0.0, "disk": 0.0, "remote": 0.0}
        try:
            local, to_disk_keys = [], set()
            for order in orders.saves:
                to_host = order.to_host and mover.host is not None
                to_disk = (order.to_disk and mover.disk is not None
                           and order.key not in to_disk_keys and not mover.disk.contains(order.key))
                if to_disk:
                    to_disk_keys.add(order.key)
                if to_host or to_disk:
                    local.append((order.blocks, order.key, to_host, to_disk, order.checkpoint))
            # In order (the planner's host mirror replays it), each run of blocks that go
            # to disk or to host only in one batch, timed as that tier.
            for tier, run in itertools.groupby(local, key=lambda s: "disk" if s[3] else "host"):
                run = list(run)
                start = time.perf_counter()
                mover.save_many(run)
                seconds[tier] += time.perf_counter() - start
                timed[tier] += len(run)
                saved["host"] += self._nbytes(whole for _, _, to_host, _, whole in run
                                              if to_host)
                saved["disk"] += self._nbytes(whole for _, _, _, to_disk, whole in run
                                              if to_disk)
            remote = [o for o in orders.saves if o.to_remote] if self.remote is not None else []
            if remote:
                start = time.perf_counter()
                rows = mover.gather_many([(o.blocks, o.checkpoint) for o in remote])
                self.remote.submit([(o.key, row, mover.block_size) for o, row in zip(remote, rows)])
                seconds["remote"] += time.perf_counter() - start
                timed["remote"] = len(remote)
                saved["remote"] = self._nbytes(o.checkpoint for o in remote)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: saving blocks failed; they will be recomputed "
                             "when needed")
        for tier, n in saved.items():
            self._stats.count("save_bytes", tier, n)
            if timed[tier]:
                self._stats.observe("save_seconds", tier, seconds[tier])

    def _prefetch(self, mover: BlockMover, keys: Sequence[tuple[str, bool]]) -> None:
        """Read ``keys`` ((key, whether a checkpoint copy) pairs) from disk into the host
        tier, timed as disk loads. A block that missed is found missing when a load asks
        for it (see ``TierPlanner``)."""
        self._moved = True
        try:
            corrupt = _corrupt_count(mover.disk) if mover.disk is not None else 0
            start = time.perf_counter()
            put = mover.prefetch(list(keys))
            self._loaded("disk", self._nbytes(checkpoint for (_, checkpoint), ok in zip(keys, put)
                                              if ok), time.perf_counter() - start)
            if mover.disk is not None:
                self._stats.count("verify_failed_blocks", "disk",
                                  _corrupt_count(mover.disk) - corrupt)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: prefetching blocks failed; they load from "
                             "disk or are recomputed")

    def close(self) -> None:
        """Send the remote saves still queued (a few seconds at most); stop using the
        remote tier: the loads still out are reported as failed by the next
        ``take_finished_loads``."""
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.reader is not None:
            self.reader.close()

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (none with ``fail_requests``).
        O(1)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_requests(self, finished: set[str]) -> set[str]:
        """Those of ``finished`` (``take_finished_loads``) whose load failed, with
        ``fail_requests``. O(finished)."""
        failed = self._failed_requests & finished
        self._failed_requests -= failed
        return failed

    def _fail(self, loads: Iterable[tuple[str, int]]) -> None:
        """Record failed loads, as (request id, block id) pairs."""
        for request_id, block_id in loads:
            if self.fail_requests:
                self._failed_requests.add(request_id)
            else:
                self._load_errors.add(block_id)

    def take_stats(self) -> KVBackendStats | None:
        """What moved since the last call and, if anything did, the host and disk
        tiers' occupancy; None when nothing moved. O(1)."""
        mover = self.mover
        if not self._moved or mover is None:
            return None
        stats, self._stats, self._moved = self._stats, KVBackendStats(), False
        for tier, store in (("host", mover.host), ("disk", mover.disk)):
            if store is not None:
                stats.set_gauge("used_bytes", tier, self.rank, store.bytes_used)
                stats.set_gauge("capacity_bytes", tier, self.rank, store.max_bytes)
        return stats


def _corrupt_count(tier: object) -> int:
    """Blocks ``tier`` (a DiskTier or RemoteTier) has found corrupt so far."""
    return tier.stats().get("corrupt", 0)


def cache_layers(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                 layer_names: Sequence[str], num_blocks: int,
                 state_layer_names: Sequence[str] = ()) -> tuple[list[torch.Tensor], int]:
    """The distinct KV tensors of ``layer_names`` and the dimension that indexes their
    ``num_blocks`` blocks (vLLM's CPU layout ``[2, num_blocks, ...]``: 1). The state
    layers (Mamba / linear attention) add none: in vLLM's hybrid layout their state
    tensors are views, block for block, of buffers whose pages the attention layers'
    tensors span, so moving such a tensor's block moves the state page too (checked).
    Raises ValueError for a layout this cannot place. O(layers)."""
    layers, seen = [], set()
    for name in [*layer_names, *state_layer_names]:
        if kv_caches.get(name) is None:
            raise ValueError(f"no KV cache tensor for layer {name}")
    for name in layer_names:
        tensor = kv_caches[name]
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            layers.append(tensor)
    if not layers:
        raise ValueError("no attention layer's KV tensor spans the state layers' pages")
    shape = list(layers[0].shape)
    dims = [d for d, size in enumerate(shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"no dimension of the KV cache shape {shape} indexes {num_blocks} blocks")
    block_dim = 1 if len(dims) > 1 and shape[0] == 2 and 1 in dims else dims[0]
    for name in state_layer_names:
        views = kv_caches[name]
        for state in [views] if isinstance(views, torch.Tensor) else views:
            if not any(_spans_pages(layer, block_dim, state, num_blocks) for layer in layers):
                raise ValueError(f"a state tensor of layer {name} is not a per-block view of "
                                 "a buffer an attention layer's KV tensor spans block by block")
    return layers, block_dim


def _spans_pages(layer: torch.Tensor, block_dim: int, state: torch.Tensor,
                 num_blocks: int) -> bool:
    """Whether ``state`` (blocks at dimension 0) lies in ``layer``'s buffer with the same
    bytes per block, and ``layer``'s blocks are its outermost dimension."""
    start, page = layer.data_ptr(), layer.nbytes // num_blocks
    return (math.prod(layer.shape[:block_dim]) == 1 and state.dim() > 0
            and state.shape[0] == num_blocks and state.stride(0) * state.element_size() == page
            and start <= state.data_ptr() < start + page)


__all__ = ["TierWorker", "cache_layers"]
