"""Host-memory, disk and remote tiers below the device KV cache, as a vLLM KV connector.

Selected by ``engine_kwargs(host_cache_gb=..., disk_cache_dir=..., disk_cache_gb=...,
remote_cache_url=...)`` (or the same keys in ``--kv-backend-config``), which set
``kv_transfer_config`` to this module. vLLM makes two kinds of instances, and this
class only adapts vLLM's calls to the part of its role:

  SCHEDULER (engine-core process): ``TierPlanner`` decides everything.
    ``prefetch`` (called by ``KVBackendScheduler.add_request``) -> ``prefetch``:
    a waiting request's disk blocks are read into host memory after the next step,
    ``get_num_new_matched_tokens`` -> ``lookup`` (host and disk hits load
    synchronously; a hit with remote blocks, or any hit under async scheduling or
    with several KV-cache groups, loads asynchronously: ``loads_async``; prompts
    with multimodal inputs or embeddings are never looked up: token ids do not name
    their KV),
    ``update_state_after_alloc`` -> ``allocated``,
    ``get_external_cache_hit_sources`` -> vLLM's ``CacheHitSource`` per tier,
    ``build_connector_meta`` -> ``plan_step`` (the orders travel as ``TierMetadata``),
    ``update_connector_output`` -> ``step_finished`` (``kv_load_failure_policy``
    is "recompute"; the manager publishes loaded tokens only once they are known
    good), ``request_finished`` / ``request_finished_all_groups`` (with the
    request's ``kv_retain_s``: the host tier
    keeps its context behind ordinary blocks, at most ``max_retained_fraction`` of
    it), and ``reset_cache`` -> ``reset``.
    ``get_kv_connector_stats``: hit tokens per tier, the device's occupancy and
    pinned blocks (read from the bound ``KVBackendManager``), when they changed.
  WORKER (each worker process): ``TierWorker`` carries out the orders:
    ``start_load_kv`` (before the forward pass when the step loads) ->
    ``start_step``, ``wait_for_save`` (after it) -> ``finish_step``,
    ``get_transfer_results`` -> ``take_finished_loads`` (the requests whose
    asynchronous loads are done; vLLM's WAITING_FOR_REMOTE_KVS ends with that report)
    and ``take_failed_requests``, ``get_block_ids_with_load_errors`` ->
    ``take_load_errors``,
    ``get_kv_connector_stats`` -> ``take_stats``.

Stats: ``kvbackend.vllm.tiers.metrics`` (``build_kv_connector_stats``,
``build_prom_metrics``): the ``kvbackend:`` series in vLLM's ``/metrics``.

Several KV-cache groups (vLLM's hybrid manager, e.g. sliding-window + full
attention): the connector is ``SupportsHMA``. A tier block is one logical block of
kvbackend's manager (``kvbackend.vllm.block_groups``), its physical block in every
group, saved and loaded as one payload under one key; the planner and the orders
name it by its logical id and its physical block per group, read from vLLM's
per-group block table (``ScheduledRequest.physical``), which the worker's
``BlockMover`` moves. vLLM takes no failed block ids with several groups (it
raises), so every hit loads asynchronously and the workers report a failed load as
a failed request (``failed_recving``), which vLLM recomputes whole. Mamba /
linear-attention hybrids ("align" mode): a block's ordinary copy holds the attention
groups' pages only, a block saved as a state checkpoint every group's (``BlockMover``
payload shapes; the host tier counts both in pages), and a hit ends on such a
checkpoint (``TierPlanner``, "State checkpoints"); the state tensors are views of the
buffers the attention layers' tensors span (``cache_layers``).

Keys name a rank-0 ``CacheIdentity`` (``kvbackend.vllm.tier_identity``); the
disk tier separates TP ranks by directory and header, the remote tier by key
prefix and header, and a disk or remote hit needs the block on every rank.
Remote loads are asynchronous: the request waits while the worker's reader thread
fetches its blocks (one round trip per request, at most ``REMOTE_STEP_BYTES``
admitted per step: the planner's ``remote_step_blocks``) and the other requests'
steps go on; a block that misses or fails its check is recomputed. Remote
saves leave the step at once (``RemoteWriter``, at most ``REMOTE_QUEUE_BYTES``
queued per worker). A cache directory other users could write to stops the
engine at start (``UnsafeCacheDirectory``); after that, best effort throughout:
nothing here raises into vLLM.

vLLM imports this module while it builds its config, in the API process, which
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is also where its CPU worker later
rebinds Triton kernels by walking ``sys.modules`` and fails on llvmlite's objects.
So the modules that load numba (through ``kvbackend.core``) are imported where
they are used: when vLLM builds a connector, after that rebinding.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, TIER_KEYS, KVBackendConfig
from kvbackend.vllm.kv_events import DISK, HOST, REMOTE
from kvbackend.vllm.request_options import request_options
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source, StepOrders
from kvbackend.vllm.tiers.metrics import KVBackendPromMetrics, KVBackendStats

if TYPE_CHECKING:  # these load numba: see the module docstring
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvbackend.ops import BlockMover
    from kvbackend.store import CacheIdentity, DiskTier, RemoteTier
    from kvbackend.vllm.tiers.planner import TierPlanner

logger = logging.getLogger("kvbackend.tiers")

_GIB = 1 << 30
REMOTE_STEP_BYTES = 256 << 20  # remote loads per step: ~0.5 s at this box's 0.4-0.7 GB/s
PREFETCH_STEP_BYTES = 64 << 20  # disk-to-host prefetches per step, read after its saves
REMOTE_QUEUE_BYTES = 1 << 30  # remote saves waiting for the network, per worker
HIT_SOURCES = {Source.HOST: CacheHitSource.HOST, Source.DISK: CacheHitSource.DISK,
               Source.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}


@dataclass
class TierMetadata(KVConnectorMetadata):
    """One step's orders, as vLLM ships them to every worker."""

    orders: StepOrders = field(default_factory=StepOrders)


class KVBackendTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbackend's host/disk tier connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        from kvbackend.vllm.tier_identity import block_nbytes
        from kvbackend.vllm.tiers.worker import TierWorker

        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvbackend's tier connector needs vLLM to pass kv_cache_config")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = KVBackendConfig.from_dict({k: extra[k] for k in TIER_KEYS if k in extra})
        self.kv_cache_config = kv_cache_config
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        # Mamba / linear-attention groups, by position (TierPlanner, cache_layers)
        self.state_groups = [g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                             if isinstance(group.kv_cache_spec, MambaSpec)]
        self.block_nbytes = block_nbytes(kv_cache_config)
        # a block of one group, every layer (one per group: the workers check each), and
        # the payload of a block's ordinary copy: a hybrid's holds no state page
        self.page_nbytes = self.block_nbytes // self.num_groups
        self.ordinary_nbytes = self.page_nbytes * (self.num_groups - len(self.state_groups))
        self.planner: TierPlanner | None = None
        # Until register_kv_caches sets up the tiers:
        self.worker = TierWorker(None, fail_requests=self.num_groups > 1)
        self._requests: dict[str, Request] = {}  # scheduler: the requests the planner knows
        self._stats = KVBackendStats()  # scheduler: tier hits since the last report
        self._device_seen = (0, -1, -1)  # scheduler: (hit tokens, used, pinned) last reported
        if role == KVConnectorRole.SCHEDULER:
            self.planner = self._make_planner()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @property
    def payload_sizes(self) -> tuple[int, ...]:
        """A tier block's payload sizes: an ordinary copy's, a checkpoint copy's."""
        return (self.ordinary_nbytes, self.block_nbytes)

    @property
    def host_bytes(self) -> int:
        return int(self.settings.host_cache_gb * _GIB)

    # ================================================================ scheduler
    def _make_planner(self) -> TierPlanner | None:
        from kvbackend.vllm.tier_identity import logical_block_size, tier_identity
        from kvbackend.vllm.tiers.planner import TierPlanner

        try:
            identity = tier_identity(self._vllm_config, self.kv_cache_config, tp_rank=0)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvbackend tiers: disabled, cannot build the cache identity: %s", e)
            return None
        disks = [self._disk_tier(replace(identity, tp_rank=rank), probe_only=True)
                 for rank in range(identity.tp_size)] if self.settings.disk_cache_dir else []
        remotes = [self._remote_tier(replace(identity, tp_rank=rank))
                   for rank in range(identity.tp_size)] if self.settings.remote_cache_url else []
        capacity = self.host_bytes // self.page_nbytes if self.page_nbytes else 0  # in pages
        backend = (self._vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        retained_fraction = backend.get("max_retained_fraction",
                                        KVBackendConfig.max_retained_fraction)
        logger.info("kvbackend tiers: host %.2f GiB (%d blocks of %d bytes), disk %s, remote %s; "
                    "identity %s", self.settings.host_cache_gb,
                    self.host_bytes // max(1, self.ordinary_nbytes), self.ordinary_nbytes,
                    self.settings.disk_cache_dir or "off", remotes[0].url if remotes else "off",
                    identity.digest()[:16])
        return TierPlanner(logical_block_size(self.kv_cache_config), identity.digest(), capacity,
                           (lambda key: all(d.contains(key) for d in disks)) if disks else None,
                           (lambda keys: _held_by_all(remotes, keys)) if remotes else None,
                           max(1, REMOTE_STEP_BYTES // max(1, self.block_nbytes)),
                           max_retained=int(capacity * retained_fraction),
                           prefetch_step_blocks=PREFETCH_STEP_BYTES // max(1, self.block_nbytes),
                           max_steps_in_flight=self._vllm_config.max_concurrent_batches,
                           all_loads_async=self.num_groups > 1 or bool(
                               self._vllm_config.scheduler_config.async_scheduling),
                           state_groups=self.state_groups,
                           payload_weights=(self.ordinary_nbytes // self.page_nbytes,
                                            self.num_groups),
                           draft_lookahead=self._vllm_config.num_prefill_lookahead_tokens)

    def _remote_tier(self, identity: CacheIdentity) -> RemoteTier:
        """The remote tier of one rank (nothing connects until its first call)."""
        from kvbackend.store import RemoteTier

        return RemoteTier(self.settings.remote_cache_url, identity,
                          checksum_key=self.settings.remote_checksum_key(),
                          password=self.settings.remote_password(),
                          payload_sizes=self.payload_sizes)

    def prefetch(self, request: Request) -> None:
        """On the request's arrival: have the workers read its disk blocks into their
        host tiers (``TierPlanner.prefetch``, at most ``PREFETCH_STEP_BYTES`` a step).
        O(new tokens) plus a stat per rank per disk block probed."""
        from kvbackend.vllm.namespace import namespace_bytes, request_namespace

        planner = self.planner
        if planner is None or request.mm_features or request.prompt_embeds is not None:
            return
        try:
            self._requests[request.request_id] = request
            planner.prefetch(request.request_id, request.all_token_ids,
                             namespace_bytes(request_namespace(request)))
        except Exception:  # noqa: BLE001 - never fail the scheduler for a cache
            logger.exception("kvbackend tiers: prefetch failed; the request loads from disk")

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens host / disk / remote hold past the device hit (``TierPlanner.lookup``:
        O(new tokens) plus O(1) per hit block and a stat per rank per disk hit)."""
        from kvbackend.vllm.namespace import namespace_bytes, request_namespace

        planner = self.planner
        if planner is None or request.mm_features or request.prompt_embeds is not None:
            return 0, False
        try:
            self._requests[request.request_id] = request
            hit = planner.lookup(request.request_id, request.all_token_ids,
                                 namespace_bytes(request_namespace(request)),
                                 num_computed_tokens)
            return hit, hit > 0 and planner.loads_async(request.request_id)
        except Exception:  # noqa: BLE001 - never fail the scheduler for a cache
            logger.exception("kvbackend tiers: lookup failed; treating as a miss")
            planner.request_finished(request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Load orders for the adopted tier hit. O(adopted blocks)."""
        if self.planner is None:
            return
        block_ids, physical = self._tier_blocks(blocks.get_block_ids(), check=True)
        try:
            self.planner.allocated(request.request_id, block_ids, num_external_tokens, physical)
            if num_external_tokens:
                for source, n in self.planner.hit_sources(request.request_id,
                                                          num_external_tokens).items():
                    self._stats.count("hit_tokens", source.value, n)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: planning loads failed; they are recomputed")
            self.planner.forget_host()
            if num_external_tokens:
                self.planner.fail_loads(request.request_id, block_ids)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Tokens per tier of the request's tier hit. O(1)."""
        if self.planner is not None:
            sources = self.planner.hit_sources(request.request_id, num_external_tokens)
            if sources:
                return {HIT_SOURCES[source]: n for source, n in sources.items()}
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads, saves and drops (``TierPlanner.plan_step``). O(scheduled
        requests + blocks to consider), plus O(new tokens) to extend keys."""
        if self.planner is None:
            return TierMetadata()
        scheduled = []
        state = scheduler_output.kv_connector_block_state
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            block_ids = state.get_block_ids(request_id) if state is not None else None
            if request is not None and block_ids is not None:
                scheduled.append(ScheduledRequest(request_id, request.num_computed_tokens,
                                                  num_tokens, *self._tier_blocks(block_ids)))
        try:
            orders = self.planner.plan_step(scheduled)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: planning saves failed; the host tier starts over")
            self.planner.forget_host()
            orders = self.planner.plan_step(())
        self._announce_tier_changes(orders)
        return TierMetadata(orders)

    def _tier_blocks(self, block_ids: tuple[list[int], ...], check: bool = False
                     ) -> tuple[Sequence[int], Sequence[tuple[int, ...]]]:
        """A request's tier blocks: their logical ids and, with several groups, their
        physical block per group (``BlockGroups.tier_blocks`` of the bound manager;
        ``check``: raise ValueError for a table kvbackend's manager did not make)."""
        return self._kv_cache_manager.groups.tier_blocks(block_ids, check)

    def _announce_tier_changes(self, orders: StepOrders) -> None:
        """KV events (``--kv-events-config``, ``kv_events.py``): first what the planner
        learned of disk and remote keys since the last step (``TierFact``), then what
        the orders change, in the order the workers apply them: clear, drops, loads,
        saves, prefetches. O(facts + orders)."""
        facts = self.planner.take_tier_facts()
        events = getattr(self._kv_cache_manager, "kv_events", None)  # bound: kvbackend's
        if events is None:
            return
        tiers = {Source.DISK: DISK, Source.REMOTE: REMOTE}
        for fact in facts:
            if fact.block_id is None:
                events.tier_removed(tiers[fact.source], fact.key)
            else:
                events.tier_stored(tiers[fact.source], fact.key, fact.block_id)
        if orders.clear_host:
            events.tier_cleared(HOST)
        if orders.disk_off:
            events.tier_cleared(DISK)
            events.tier_cleared(REMOTE)
        for key in orders.drops:
            events.tier_removed(HOST, key)
        for order in orders.loads:
            if order.promote and not order.checkpoint:
                events.tier_stored(HOST, order.key, order.block_id)
        for order in orders.saves:
            if order.checkpoint:  # its block's own copy is announced
                continue
            for tier, ordered in ((HOST, order.to_host), (DISK, order.to_disk),
                                  (REMOTE, order.to_remote)):
                if ordered:
                    events.tier_stored(tier, order.key, order.block_id)
        for key, checkpoint in orders.prefetches:
            if not checkpoint:  # its block's own copy is announced
                events.tier_copied(DISK, HOST, key)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The step ran; its failed loads are known. O(loads of that step)."""
        if self.planner is not None:
            self.planner.step_finished(connector_output.invalid_block_ids or (),
                                       connector_output.finished_recving or (),
                                       connector_output.failed_recving or ())

    def get_kv_connector_stats(self) -> KVBackendStats | None:
        """Scheduler: tier hits since the last call, and the device's numbers when they
        changed; worker: ``TierWorker.take_stats``. None when there is nothing new."""
        if self.role != KVConnectorRole.SCHEDULER:
            return self.worker.take_stats()
        stats, self._stats = self._stats, KVBackendStats()
        try:
            self._device_stats(stats)
        except Exception:  # noqa: BLE001 - never fail the step for a metric
            logger.exception("kvbackend tiers: reading the device cache's numbers failed")
        return None if stats.is_empty() else stats

    def _device_stats(self, stats: KVBackendStats) -> None:
        """The device tier's hit tokens since the last report, blocks with content and
        pinned blocks, from the bound ``KVBackendManager``. O(pins)."""
        manager = self._kv_cache_manager
        cache = getattr(manager, "cache", None)
        if cache is None:  # not kvbackend's manager (refused at start-up)
            return
        counts = cache.block_counts()
        seen = (manager.hit_tokens, counts.usable - counts.free, cache.num_pinned_blocks)
        if seen == self._device_seen:
            return
        stats.count("hit_tokens", "device", seen[0] - self._device_seen[0])
        self._device_seen = seen
        block_bytes = self.block_nbytes * self._vllm_config.parallel_config.tensor_parallel_size
        stats.set_gauge("used_bytes", "device", "scheduler", seen[1] * block_bytes)
        stats.set_gauge("capacity_bytes", "device", "scheduler",
                        counts.usable * block_bytes)
        stats.set_gauge("pinned_blocks", "device", "scheduler", seen[2])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBackendStats:
        return KVBackendStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVBackendPromMetrics:
        return KVBackendPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict | None]:
        """``SupportsHMA``: several KV-cache groups; as ``request_finished``."""
        return self.request_finished(request, block_ids[0])

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A tier block holds every group's KV, so a load restores every group."""
        return tuple(range(self.num_groups))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request; its blocks are freed at once (saves ran in its steps). O(1)."""
        self._requests.pop(request.request_id, None)
        if self.planner is not None:
            try:
                retain_s = request_options(request).retain_s
                self.planner.request_finished(request.request_id, retain_s)
            except Exception:  # noqa: BLE001
                logger.exception("kvbackend tiers: retaining request %s failed",
                                 request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        """After a weight update: see ``TierPlanner.reset`` (host cleared, disk off).
        O(host keys + requests)."""
        if self.planner is not None:
            if self.planner.disk_contains is not None:
                logger.warning("kvbackend tiers: reset_prefix_cache(reset_connector=True): the "
                               "disk tier is off for the rest of this process (the weights in "
                               "memory may no longer match the files that name its blocks)")
            self.planner.reset()
        self._requests.clear()
        return True

    # =================================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvbackend.store.remote_writer import RemoteWriter
        from kvbackend.vllm.tier_identity import tier_identity
        from kvbackend.vllm.tiers.worker import TierWorker

        try:
            remote = None
            if self.settings.remote_cache_url is not None:
                identity = tier_identity(self._vllm_config, self.kv_cache_config,
                                         tp_rank=_tp_rank())
                remote = RemoteWriter(self._remote_tier(identity), REMOTE_QUEUE_BYTES)
            self.worker = TierWorker(self._make_mover(kv_caches), remote, rank=_tp_rank(),
                                     fail_requests=self.num_groups > 1)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvbackend tiers: disabled on this worker (its loads are "
                           "recomputed): %s", e)

    def _make_mover(self, kv_caches: dict[str, torch.Tensor]) -> BlockMover:
        from kvbackend.ops import BlockMover, block_layout
        from kvbackend.store import HostTier
        from kvbackend.store.disk_tier import DiskMode
        from kvbackend.vllm.tier_identity import (
            logical_block_size, pages_per_block, tier_identity,
        )
        from kvbackend.vllm.tiers.worker import cache_layers

        config = self.kv_cache_config
        groups = config.kv_cache_groups
        layers, block_dim = cache_layers(
            kv_caches, [name for g, group in enumerate(groups) if g not in self.state_groups
                        for name in group.layer_names], config.num_blocks,
            [name for g in self.state_groups for name in groups[g].layer_names])
        nbytes = block_layout(layers, block_dim).block_nbytes * sum(pages_per_block(config))
        if nbytes != self.block_nbytes:
            raise ValueError(f"a logical block of every group holds {nbytes} bytes over the KV "
                             f"tensors, expected {self.block_nbytes} from the KV cache "
                             "specs (e.g. groups with different numbers of layers)")
        rank = _tp_rank()
        host = HostTier(self.host_bytes) if self.host_bytes > 0 else None
        disk = None
        if self.settings.disk_cache_dir is not None:
            disk = self._disk_tier(tier_identity(self._vllm_config, config, tp_rank=rank),
                                   checksum_key=self.settings.disk_checksum_key())
            if disk.mode is not DiskMode.RW:
                logger.warning("kvbackend tiers: disk tier at %s is %s; the server keeps "
                               "serving without persisting KV blocks", self.settings.disk_cache_dir,
                               "read-only" if disk.mode is DiskMode.RO else "disabled")
        return BlockMover(layers, block_dim, self.block_nbytes, logical_block_size(config),
                          host, disk, self.state_groups)

    def _disk_tier(self, identity: CacheIdentity, **options: Any) -> DiskTier:
        """The disk tier of one rank: ``disk_cache_gb`` split evenly across the ranks.
        Raises ``UnsafeCacheDirectory`` for a directory other users could write to."""
        from kvbackend.store import DiskTier

        settings = self.settings
        bound = int(settings.disk_cache_gb * _GIB) // identity.tp_size
        return DiskTier(settings.disk_cache_dir, bound, identity,
                        payload_sizes=self.payload_sizes,
                        shared_group=settings.disk_cache_shared_group, **options)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """The step's clears, drops and loads, before the forward pass. O(drops + loaded
        bytes)."""
        orders = self._orders()
        if orders is not None:
            self.worker.start_step(orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads complete before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # saves gather all layers at once in wait_for_save

    def wait_for_save(self) -> None:
        """The step's saves, after the forward pass. O(saved bytes)."""
        orders = self._orders()
        if orders is not None:
            self.worker.finish_step(orders)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads done since the last call, and with several groups
        those that failed (``TierWorker.take_failed_requests``)."""
        try:
            finished = self.worker.take_finished_loads()
            failed = self.worker.take_failed_requests(finished)
            return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)
        except Exception:  # noqa: BLE001 - never fail the step for a cache
            logger.exception("kvbackend tiers: collecting remote loads failed")
            return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (with one group). O(1)."""
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        self.worker.close()  # the remote saves still queued go out first

    def _orders(self) -> StepOrders | None:
        meta = self._connector_metadata
        return meta.orders if isinstance(meta, TierMetadata) else None


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialised: a single worker
        return 0


def _held_by_all(remotes: list[RemoteTier], keys: list[str]) -> list[bool]:
    """Whether every rank's remote tier holds each of ``keys``: one round trip per rank
    for the keys the ranks before it all hold, stopping once none is left; none for a
    rank whose server is out (its breaker answers all False at once while a
    health-check thread waits for the server)."""
    held = [True] * len(keys)
    for remote in remotes:
        asked = [i for i, h in enumerate(held) if h]
        if not asked:
            break
        for i, present in zip(asked, remote.present_many([keys[i] for i in asked])):
            held[i] = present
    return held


__all__ = ["HIT_SOURCES", "KVBackendTierConnector", "TierMetadata"]
