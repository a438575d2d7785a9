"""HiCache L3 storage (``--hicache-storage-backend dynamic``) on kvbackend's ``DiskTier``, or
on its ``RemoteTier`` (Redis / Valkey) that a fleet of instances shares.

SGLang names a page by a 64-hex sha256 chain over the token pages; a request's
``cache_salt``/``extra_key`` enters only through the chain's seed, and the model,
dtype and parallel shard not at all (anchors §5e). So every file key here is

    sha256("kvbackend-sglang-page-v1" | identity digest | len(namespace) namespace | sglang key)

and the file lives under ``<disk_cache_dir>/v2/<identity digest>/``, whose header
repeats the identity digest and a BLAKE3 checksum of header and payload. The
identity (``CacheIdentity``) holds the weights fingerprint (of
``extra_config["model_path"]`` when given, else of the model name), the kv
dtype and page size of the host pool, the host layout, and the TP/PP/CP
shard -- not the DP group: its pages are the same in every group, so a request
routed to another group still hits (SGLang's own file backend shares them too).
``extra_config["namespace"]`` adds a deployment-wide salt on top of SGLang's
per-request one. Writes are atomic, corrupt files read as misses and
are deleted, and the directory is LRU-bounded by ``max_bytes`` (all DiskTier).

With ``extra_config["remote_cache_url"]`` (``redis://[[user]:password@]host[:port][/db]``,
``rediss://``, ``unix://``) the pages go to that server instead of a directory: the same
keys (``kvb:v2:<identity digest>:<file key>``, the vLLM remote tier's layout) and the same
header and checks, one pipelined round trip per batch; the server's ``maxmemory`` policy
bounds it, and a server that is away is a miss and a failed backup, with one warning
(``kvbackend.store.remote_tier``). ``remote_cache_password_file`` and
``remote_cache_key_file`` (0600 files: the server's password, a 32-byte checksum key)
as in vLLM's ``--kv-backend-config``.

extra_config keys (all optional): ``disk_cache_dir`` (default
``$KVBACKEND_SGLANG_DISK_DIR``, else ``default_directory()``: per user, never a
shared /tmp), ``max_bytes`` (default 64 GiB), ``model_path``, ``namespace``,
``durable`` (fsync, default true), ``interface_v1`` (SGLang then calls
``batch_get_v1``/``batch_set_v1``), ``remote_cache_url``, ``remote_cache_password_file``,
``remote_cache_key_file``.

With ``--enable-metrics`` each batch's page count and bandwidth are reported
through ``get_stats()`` as SGLang's ``StorageMetrics``. Hybrid models (extra SWA,
Mamba, DSA-indexer or MTP pools, SGLang's ``*_v2`` calls) are refused when the
backend is attached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvbackend.sglang.page_store import DiskPages, RemotePages
from kvbackend.store import CacheIdentity, DiskTier, model_fingerprint
from kvbackend.store.checksum_key import load_checksum_key
from kvbackend.store.remote_tier import RemoteTier, read_password_file

logger = logging.getLogger("kvbackend.sglang")

DEFAULT_MAX_BYTES = 64 << 30
_DOMAIN = b"kvbackend-sglang-page-v1\0"


def default_directory() -> str:
    """``$XDG_CACHE_HOME/kvbackend/sglang-hicache``, else ``~/.cache/kvbackend/sglang-hicache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvbackend", "sglang-hicache")


def page_identity(config: HiCacheStorageConfig, *, kv_dtype: str, page_size: int,
                  kv_layout: str) -> CacheIdentity:
    """What a stored page depends on besides its tokens, from SGLang's storage config."""
    extra = dict(config.extra_config or {})
    model_path = extra.get("model_path")
    if model_path:
        fingerprint = model_fingerprint(model_path)
    elif config.model_name:
        fingerprint = "name:" + hashlib.sha256(config.model_name.encode()).hexdigest()
        logger.warning("kvbackend HiCache storage: no extra_config model_path, so pages are "
                       "keyed by the model name %r, not by its weights", config.model_name)
    else:
        raise ValueError("kvbackend HiCache storage needs model_name or extra_config model_path")
    # MLA pages are the same on every TP rank (SGLang writes them from one rank only).
    tp_rank, tp_size = (0, 1) if config.is_mla_model else (config.tp_rank, config.tp_size)
    shard = dict(pp=f"{config.pp_rank}/{config.pp_size}",
                 attn_cp=f"{config.attn_cp_rank}/{config.attn_cp_size}",
                 dcp=f"{config.dcp_rank}/{config.dcp_size}",
                 mla=str(int(config.is_mla_model)), split_heads=str(int(config.should_split_heads)),
                 tp_lcm=str(config.tp_lcm_size), model_name=str(config.model_name),
                 namespace=str(extra.get("namespace", "")))
    return CacheIdentity(model_fingerprint=fingerprint, kv_dtype=kv_dtype, block_size=page_size,
                         kv_layout=kv_layout, tp_rank=tp_rank, tp_size=tp_size,
                         extra=tuple(shard.items()))


def file_key(identity_digest: str, namespace: str, sglang_key: str) -> str:
    """Our block key for one SGLang page key: identity and namespace hashed in. O(1)."""
    ns = namespace.encode()
    h = hashlib.sha256(_DOMAIN)
    h.update(identity_digest.encode())
    h.update(struct.pack("<I", len(ns)) + ns)
    h.update(sglang_key.encode())
    return h.hexdigest()


def _bytes_of(tensor: torch.Tensor):
    """A CPU tensor's bytes as a numpy uint8 array (no copy when contiguous on CPU)."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy()


class KVBackendHiCacheStorage(HiCacheStorage):
    """One checksummed file per KV page, LRU-bounded, keyed by page hash + model identity.

    Built by SGLang as ``KVBackendHiCacheStorage(storage_config, kwargs)``; the host
    pool arrives later through ``register_mem_pool_host`` and fixes the kv dtype,
    page size and layout, so the disk tier opens then.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.directory = (extra.get("disk_cache_dir") or extra.get("file_storage_path")
                          or os.environ.get("KVBACKEND_SGLANG_DISK_DIR") or default_directory())
        self.max_bytes = int(extra.get("max_bytes", DEFAULT_MAX_BYTES))
        self.namespace = str(extra.get("namespace", ""))
        self.durable = bool(extra.get("durable", True))
        self.remote_url = extra.get("remote_cache_url")
        password_file = extra.get("remote_cache_password_file")
        self.remote_password = read_password_file(password_file) if password_file else None
        self.remote_key = load_checksum_key(extra.get("remote_cache_key_file"), env={})
        self.mem_pool_host = None
        self.tier: Optional[DiskPages | RemotePages] = None
        self.page_size: Optional[int] = None
        self.metrics = StorageMetrics() if storage_config.enable_storage_metrics else None
        self._metrics_lock = threading.Lock()  # batches run on SGLang's I/O threads

    # ----------------------------------------------------------------- set-up
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None) or (
            "page_first" if self.config.is_page_first_layout else "layer_first")
        self.open(kv_dtype=str(mem_pool_host.dtype).removeprefix("torch."),
                  page_size=int(mem_pool_host.page_size), kv_layout=f"sglang-host-{layout}")

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang registers every host pool here; only the KV pool is served: a hybrid
        model's extra pools would need ``batch_exists_v2`` and friends."""
        if host_pool_name != PoolName.KV and host_pool is not self.mem_pool_host:
            raise ValueError(
                f"kvbackend HiCache storage does not support hybrid models (extra "
                f"{getattr(host_pool_name, 'value', host_pool_name)!r} pool: SWA, Mamba, DSA "
                "indexer or MTP draft pools); use SGLang's file backend for this model")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def open(self, *, kv_dtype: str, page_size: int, kv_layout: str) -> None:
        """Open the disk tier for pages of this dtype, size and layout (done by
        ``register_mem_pool_host``; call it directly to use the backend without a pool)."""
        identity = page_identity(self.config, kv_dtype=kv_dtype, page_size=page_size,
                                 kv_layout=kv_layout)
        self.page_size = page_size
        if self.remote_url:
            self.tier = RemotePages(RemoteTier(self.remote_url, identity,
                                               checksum_key=self.remote_key,
                                               password=self.remote_password))
        else:
            self.tier = DiskPages(DiskTier(self.directory, self.max_bytes, identity,
                                           read_only=not self.config.is_storage_writer,
                                           durable=self.durable))

    def _key(self, key: str) -> str:
        if self.tier is None:
            raise RuntimeError("kvbackend HiCache storage used before register_mem_pool_host")
        return file_key(self.tier.identity_digest, self.namespace, key)

    # -------------------------------------------------------------- key-value
    def exists(self, key: str) -> bool:
        """One ``stat`` (disk) or one round trip (remote). O(1)."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of leading keys present (disk: one ``stat`` each, stops at the first
        miss; remote: one round trip)."""
        return self.tier.contains_prefix([self._key(k) for k in keys])

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """The verified page, read into ``target_location`` (a flat CPU tensor, the host
        pool's page) if given (from disk with no copy besides the read:
        ``DiskTier.get_into``); None on a miss, a corrupt value or a page of another
        size. O(page bytes)."""
        return self._read([key], [target_location])[0]

    def _read(self, keys: List[str], targets: list) -> List[torch.Tensor | None]:
        """``get`` of each key into its target (None: a new tensor), one batch."""
        views = [None if t is None else t.view(torch.uint8).view(-1).numpy() for t in targets]
        payloads = self.tier.read_many([self._key(k) for k in keys], views)
        return [None if p is None else t if t is not None
                else torch.frombuffer(bytearray(p), dtype=torch.uint8)
                for p, t in zip(payloads, targets)]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """``get`` of each key. O(keys * page bytes)."""
        start, targets = time.perf_counter(), target_locations or [None] * len(keys)
        pages = self._read(keys, targets)
        self._measure("prefetch", start, [p for p in pages if p is not None])
        return pages

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store one page. O(page bytes)."""
        page = value if value is not None else target_location
        if page is None:
            raise ValueError("set needs a value")
        return self._store([key], [page])[0]

    def _store(self, keys: List[str], pages: list) -> List[bool]:
        return self.tier.put_many([(self._key(k), _bytes_of(p), self.page_size)
                                   for k, p in zip(keys, pages)])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
                  ) -> bool:
        """``set`` of each key; True if all were stored. O(keys * page bytes)."""
        start, pages = time.perf_counter(), values if values is not None else target_locations
        done = all(self._store(keys, pages))
        self._measure("backup", start, pages)
        return done

    # ---------------------------------------------- v1: straight from host pages
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Load page i into the host pool at ``host_indices[i * page_size]``.
        O(keys * page bytes)."""
        start, pool = time.perf_counter(), self.mem_pool_host
        loaded = self._read(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(loaded):
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * self.page_size]), page)
        self._measure("prefetch", start, [page for page in loaded if page is not None])
        return [page is not None for page in loaded]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store the host pool's page at ``host_indices[i * page_size]`` as key i.
        O(keys * page bytes)."""
        start, pool = time.perf_counter(), self.mem_pool_host
        pages = [pool.get_data_page(int(host_indices[i * self.page_size]))
                 for i in range(len(keys))]
        done = self._store(keys, pages)
        self._measure("backup", start, pages)
        return done

    # ------------------------------------------------------------------- misc
    def clear(self) -> None:
        """Delete every page of this identity on disk (other models' pages stay); a
        remote server's pages stay (``RemotePages.clear``). O(its files)."""
        if self.tier is not None:
            self.tier.clear()

    def _measure(self, kind: str, start: float, pages: list) -> None:
        """Record one batch (``kind`` "prefetch" or "backup") for ``get_stats``."""
        if self.metrics is None or not pages:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        nbytes = sum(page.numel() * page.element_size() for page in pages)
        with self._metrics_lock:
            getattr(self.metrics, f"{kind}_pgs").append(len(pages))
            getattr(self.metrics, f"{kind}_bandwidth").append(nbytes / seconds / 1e9)  # GB/s

    def get_stats(self) -> Optional[StorageMetrics]:
        """The batches since the last call, as SGLang's ``StorageMetrics`` (page counts and
        GB/s per batch); None without ``--enable-metrics``."""
        if self.metrics is None:
            return None
        with self._metrics_lock:
            stats, self.metrics = self.metrics, StorageMetrics()
        return stats
