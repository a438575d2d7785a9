"""Host-memory and disk tiers below the device KV cache, as a vLLM KV connector.

Selected by ``engine_kwargs(host_cache_gb=..., disk_cache_dir=..., disk_cache_gb=...)``
(or the same keys in ``--kv-backend-config``), which set ``kv_transfer_config``
to this module. Two instances run: the SCHEDULER one in the engine-core process
decides everything, the WORKER one in each worker process moves bytes.

Keys. Every full block of a request's tokens has a chained sha256 key
(:mod:`kvbackend.store.block_key`) over the tokens of the whole prefix, the
request's namespace (LoRA name, cache_salt: ``kvbackend.vllm.namespace``) and a
:class:`CacheIdentity` (model weights fingerprint, kv dtype, block size, KV
layout, TP size, format version). The disk tier additionally separates TP ranks
by directory and header (its identity carries the rank).

Scheduler side, per request:
  * ``get_num_new_matched_tokens``: from the end of the device hit (which vLLM
    hands over block-aligned), the longest run of consecutive keys present in
    host memory (a mirror index: the scheduler alone decides what the workers'
    host tiers hold, LRU by bytes) or on disk (a ``stat`` per block: other
    processes' blocks count). Synchronous load; capped at ``num_tokens - 1``.
  * ``update_state_after_alloc``: a load order per hit block (destination block
    id, key); a block found on disk is also promoted to host.
  * ``build_connector_meta``: a save order for every block that becomes complete
    in this step (prompt and output) and is not yet in host (resp. on disk);
    host evictions become drop orders.
  * ``update_connector_output``: blocks that failed to load void that request's
    orders of the step (the worker skipped them); vLLM recomputes from the first
    failed block (``kv_load_failure_policy="recompute"``) and the manager never
    published them (see ``KVBackendManager``).

Worker side, per step (bytes move through ``kvbackend.ops.BlockMover``, a block at a time,
without staging copies on a CPU cache): ``start_load_kv`` (before the forward pass) takes each
block from host, else disk (read straight into its buffer and verified there:
checksum, identity, size), and scatters it into its block in all layers; a miss
or a bad block is reported by ``get_block_ids_with_load_errors`` and scattered
nowhere. ``wait_for_save`` (after the forward pass, so the bytes are final)
applies drops, then gathers each saved block (all layers) straight into the
array the host tier keeps and/or writes it to ``DiskTier`` (atomic, checksummed
writes). Saves run synchronously here rather than being deferred to the next
step: on the CPU there is no copy engine to overlap with, and a block must be
read before any later step can reuse it.

Best effort throughout: nothing here raises into vLLM; a failed save is a
future miss and a failed load is recomputed.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)

from kvbackend.ops import BlockMover
from kvbackend.store import DiskTier, HostTier, compute_block_keys
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.namespace import namespace_bytes, request_namespace
from kvbackend.vllm.tier_identity import block_nbytes, tier_identity

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbackend.tiers")

_GIB = 1 << 30
_DISK_KNOWN_MAX = 1 << 20  # keys remembered as written to disk (beyond: a stat decides)


@dataclass
class TierMetadata(KVConnectorMetadata):
    """One step's orders for the workers; plain lists of tuples (cheap to pickle)."""

    loads: list[tuple[str, int, str, bool]] = field(default_factory=list)
    """(request id, destination block id, key, promote to host)"""
    saves: list[tuple[str, int, str, bool, bool]] = field(default_factory=list)
    """(request id, source block id, key, to host, to disk)"""
    drops: list[str] = field(default_factory=list)
    """keys to remove from the host tier, applied before this step's saves"""


@dataclass(slots=True)
class _Req:
    request: Request
    namespace: bytes
    keys: list[str] = field(default_factory=list)  # chained keys of full blocks, in order
    num_checked: int = 0  # blocks [0, num_checked) already considered for saving


@dataclass(slots=True)
class _StepRecord:
    """What one request was ordered in the step in flight, to undo on a failed load."""

    load_blocks: dict[int, str] = field(default_factory=dict)  # block id -> key
    first_load_index: int = 0
    host_inserted: list[str] = field(default_factory=list)
    disk_ordered: list[str] = field(default_factory=list)


class KVBackendTierConnector(KVConnectorBase_V1):
    """kvbackend's host/disk tier connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = KVBackendConfig.from_dict(
            {k: extra[k] for k in ("host_cache_gb", "disk_cache_dir", "disk_cache_gb")
             if k in extra})
        if kv_cache_config is None:
            raise ValueError("kvbackend's tier connector needs vLLM to pass kv_cache_config")
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.block_nbytes = block_nbytes(kv_cache_config)
        self.host_bytes = int(self.settings.host_cache_gb * _GIB)
        self.disk_bytes = int(self.settings.disk_cache_gb * _GIB)
        self.enabled = True
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)
        else:
            self._init_worker(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ================================================================ scheduler
    def _init_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.host_capacity = self.host_bytes // self.block_nbytes if self.block_nbytes else 0
        self._host: OrderedDict[str, None] = OrderedDict()  # mirror of the workers' host tiers
        self._drops: list[str] = []
        self._disk_known: OrderedDict[str, None] = OrderedDict()
        self._disks: list[DiskTier] = []
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, tuple[int, list[str]]] = {}
        self._loads: list[tuple[str, int, str, bool]] = []
        self._records: dict[str, _StepRecord] = {}
        self._inflight: dict[str, _StepRecord] = {}
        self._hit_sources: dict[str, dict[str, int]] = {}
        try:
            identity = tier_identity(vllm_config, kv_cache_config, tp_rank=0)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvbackend tiers: disabled, cannot build the cache identity: %s", e)
            self.enabled = False
            return
        self.key_digest = identity.digest()  # rank 0's identity names the blocks
        if self.settings.disk_cache_dir is not None:
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            for rank in range(tp_size):
                self._disks.append(DiskTier(self.settings.disk_cache_dir, self.disk_bytes,
                                            replace(identity, tp_rank=rank),
                                            read_only=True, rescan_interval_s=None))
        logger.info("kvbackend tiers: host %.2f GiB (%d blocks of %d bytes), disk %s; identity %s",
                    self.settings.host_cache_gb, self.host_capacity, self.block_nbytes,
                    self.settings.disk_cache_dir or "off", self.key_digest[:16])

    def _state(self, request: Request) -> _Req | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            if request.mm_features or request.prompt_embeds is not None:
                return None  # token ids do not name these prompts' KV
            st = _Req(request, namespace_bytes(request_namespace(request)))
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Req, num_blocks: int) -> list[str]:
        have = len(st.keys)
        if num_blocks > have:
            tokens = st.request.all_token_ids[have * self.block_size: num_blocks * self.block_size]
            st.keys.extend(compute_block_keys(
                tokens, self.block_size, self.key_digest, st.namespace,
                parent=st.keys[-1] if st.keys else None))
        return st.keys

    def _on_disk(self, key: str) -> bool:
        if key in self._disk_known:
            return True
        if self._disks and all(d.contains(key) for d in self._disks):
            self._remember_disk(key)
            return True
        return False

    def _remember_disk(self, key: str) -> None:
        self._disk_known[key] = None
        self._disk_known.move_to_end(key)
        if len(self._disk_known) > _DISK_KNOWN_MAX:
            self._disk_known.popitem(last=False)

    def _host_insert(self, key: str) -> bool:
        if key in self._host:
            self._host.move_to_end(key)
            return False
        if self.host_capacity <= 0:
            return False
        while len(self._host) >= self.host_capacity:
            victim, _ = self._host.popitem(last=False)
            self._drops.append(victim)
        self._host[key] = None
        return True

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        if not self.enabled:
            return 0, False
        try:
            st = self._state(request)
            bs = self.block_size
            limit = (request.num_tokens - 1) // bs
            start = -(-num_computed_tokens // bs)
            if st is None or start >= limit or num_computed_tokens % bs:
                return 0, False
            keys = self._keys(st, limit)
            sources: list[str] = []
            for key in keys[start:limit]:
                if key in self._host:
                    sources.append("host")
                elif self._disks and all(d.contains(key) for d in self._disks):
                    sources.append("disk")  # a stat: blocks of other processes count
                else:
                    break
            if not sources:
                return 0, False
            self._lookups[request.request_id] = (start, sources)
            return len(sources) * bs, False
        except Exception:  # noqa: BLE001 - never fail the scheduler for a cache
            logger.exception("kvbackend tiers: lookup failed; treating as a miss")
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.num_checked = 0  # (re)admitted: reconsider every block for saving
        if num_external_tokens <= 0 or lookup is None:
            return
        start, sources = lookup
        count = min(num_external_tokens // self.block_size, len(sources))
        (block_ids,) = blocks.get_block_ids()
        record = self._records.setdefault(request.request_id, _StepRecord())
        record.first_load_index = start
        counts = {"host": 0, "disk": 0}
        for j in range(count):
            i = start + j
            key, source = st.keys[i], sources[j]
            counts[source] += self.block_size
            if source == "host":
                self._host.move_to_end(key)
                promote = False
            else:
                self._remember_disk(key)
                promote = self._host_insert(key)
                if promote:
                    record.host_inserted.append(key)
            self._loads.append((request.request_id, block_ids[i], key, promote))
            record.load_blocks[block_ids[i]] = key
        self._hit_sources[request.request_id] = {k: v for k, v in counts.items() if v}

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int):
        sources = self._hit_sources.pop(request.request_id, None)
        if sources and sum(sources.values()) == num_external_tokens:
            return sources
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierMetadata(loads=self._loads)
        self._loads = []
        if not self.enabled:
            return meta
        try:
            self._plan_saves(scheduler_output, meta)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: planning saves failed; skipping this step's saves")
            meta.saves = []
        meta.drops, self._drops = self._drops, []
        # A key both dropped and re-saved this step: the worker drops first, then puts.
        self._inflight, self._records = self._records, {}
        return meta

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: TierMetadata) -> None:
        host_on, disk_on = self.host_capacity > 0, bool(self._disks)
        manager = self._kv_cache_manager
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or manager is None:
                continue
            request = st.request
            done = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
            num_full = done // self.block_size
            if num_full <= st.num_checked:
                continue
            keys = self._keys(st, num_full)
            (block_ids,) = manager.get_block_ids(req_id)
            record = self._records.setdefault(req_id, _StepRecord(first_load_index=num_full))
            for i in range(st.num_checked, min(num_full, len(block_ids))):
                key = keys[i]
                to_host = host_on and self._host_insert(key)
                to_disk = disk_on and not self._on_disk(key)
                if to_host:
                    record.host_inserted.append(key)
                if to_disk:
                    self._remember_disk(key)
                    record.disk_ordered.append(key)
                if to_host or to_disk:
                    meta.saves.append((req_id, block_ids[i], key, to_host, to_disk))
            st.num_checked = num_full
        if not host_on:
            return
        # Promotions and saves whose key was evicted again within this step: no put.
        meta.loads = [(r, b, k, p and k in self._host) for r, b, k, p in meta.loads]
        meta.saves = [(r, b, k, h and k in self._host, d) for r, b, k, h, d in meta.saves
                      if d or (h and k in self._host)]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = set(connector_output.invalid_block_ids or ())
        if not invalid:
            return
        for req_id, record in self._inflight.items():
            failed = invalid.intersection(record.load_blocks)
            if not failed:
                continue
            for block_id in failed:  # gone or corrupt: forget it (a bad file was deleted)
                self._host.pop(record.load_blocks[block_id], None)
                self._disk_known.pop(record.load_blocks[block_id], None)
            # The worker skipped this request's puts; vLLM recomputes from the
            # first failed block, whose blocks will be considered for saving again.
            for key in record.host_inserted:
                self._host.pop(key, None)
            for key in record.disk_ordered:
                self._disk_known.pop(key, None)
            st = self._reqs.get(req_id)
            if st is not None:
                st.num_checked = min(st.num_checked, record.first_load_index)
            logger.warning("kvbackend tiers: request %s: %d block(s) failed to load from "
                           "host/disk; they are recomputed", req_id, len(failed))
        self._inflight = {}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool | None:
        """Forget the host tier (the workers drop it with the next step); disk persists."""
        self._drops.extend(self._host)
        self._host.clear()
        return True

    # =================================================================== worker
    def _init_worker(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self._vllm_config = vllm_config
        self._kv_config = kv_cache_config
        self._mover: BlockMover | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self.enabled = False  # until register_kv_caches succeeds

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._register(kv_caches)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvbackend tiers: disabled on this worker: %s", e)
            self.enabled = False

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvbackend.ops import block_layout

        layers, seen = [], set()
        for name in self._kv_config.kv_cache_groups[0].layer_names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise ValueError(f"no KV cache tensor for layer {name}")
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                layers.append(tensor)
        num_blocks = self._kv_config.num_blocks
        shape = list(layers[0].shape)
        dims = [d for d, size in enumerate(shape) if size == num_blocks]
        if not dims:
            raise ValueError(f"no dimension of the KV cache shape {shape} indexes "
                             f"{num_blocks} blocks")
        block_dim = 1 if len(dims) > 1 and shape[0] == 2 and 1 in dims else dims[0]
        layout = block_layout(layers, block_dim)
        if layout.block_nbytes != self.block_nbytes:
            raise ValueError(f"a block holds {layout.block_nbytes} bytes over all layers, "
                             f"expected {self.block_nbytes} from the KV cache spec")
        try:
            from vllm.distributed import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised: a single worker
            rank = 0
        identity = tier_identity(self._vllm_config, self._kv_config, tp_rank=rank)
        host = HostTier(self.host_bytes) if self.host_bytes > 0 else None
        disk = None
        if self.settings.disk_cache_dir is not None:
            disk = DiskTier(self.settings.disk_cache_dir, self.disk_bytes, identity)
            if disk.mode != "rw":
                logger.warning("kvbackend tiers: disk tier at %s is %s; the server keeps "
                               "serving without persisting KV blocks", self.settings.disk_cache_dir,
                               "read-only" if disk.mode == "ro" else "disabled")
        self._mover = BlockMover(layers, block_dim, self.block_nbytes, self.block_size, host, disk)
        self.enabled = True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._failed_reqs = set()
        meta = self._connector_metadata
        if not isinstance(meta, TierMetadata) or not meta.loads:
            return
        if not self.enabled:
            self._fail_loads(meta.loads)
            return
        try:
            self._load(meta.loads)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: loading blocks failed; they are recomputed")
            self._fail_loads(meta.loads)

    def _fail_loads(self, loads: list[tuple[str, int, str, bool]]) -> None:
        for req_id, block_id, _, _ in loads:
            self._load_errors.add(block_id)
            self._failed_reqs.add(req_id)

    def _load(self, loads: list[tuple[str, int, str, bool]]) -> None:
        done = self._mover.load_many([(block_id, key, promote)
                                      for _, block_id, key, promote in loads])
        for (req_id, block_id, _, _), ok in zip(loads, done):
            if not ok:
                self._load_errors.add(block_id)
                self._failed_reqs.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous and complete before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # saves gather all layers at once in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not self.enabled or not isinstance(meta, TierMetadata):
            return
        try:
            if self._mover.host is not None:
                for key in meta.drops:
                    self._mover.host.remove(key)
            saves = [s for s in meta.saves if s[0] not in self._failed_reqs]
            if saves:
                self._save(saves)
        except Exception:  # noqa: BLE001
            logger.exception("kvbackend tiers: saving blocks failed; they will be recomputed "
                             "when needed")

    def _save(self, saves: list[tuple[str, int, str, bool, bool]]) -> None:
        for _, block_id, key, to_host, to_disk in saves:
            self._mover.save(block_id, key, to_host, to_disk)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


__all__ = ["KVBackendTierConnector", "TierMetadata"]
