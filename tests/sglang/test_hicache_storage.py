"""KVBackendHiCacheStorage driven like SGLang's cache controller: created by SGLang's
StorageBackendFactory ("dynamic"), pages from a real MHATokenToKVPoolHost on the CPU,
batch_exists / batch_get into get_dummy_flat_data_page() / batch_set of get_data_page()."""

import pytest

pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

import glob  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvbackend.sglang.hicache_storage import KVBackendHiCacheStorage  # noqa: E402
from tests.store_helpers import write_safetensors  # noqa: E402

PAGE = 4


def host_pool(dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(size=64, page_size=PAGE, dtype=dtype, head_num=2, head_dim=4,
                          layer_num=2, device="cpu", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(kv._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0,
                                page_size=PAGE, layout="layer_first", pin_memory=False,
                                device="cpu", device_capacity_tokens=64, start_layer=0,
                                end_layer=2)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(dtype))
    return host


def make_backend(tmp_path, pool, *, model_name="tiny", dp_rank=0, metrics=False,
                 **extra) -> KVBackendHiCacheStorage:
    extra = {"backend_name": "kvbackend", "module_path": "kvbackend.sglang.hicache_storage",
             "class_name": "KVBackendHiCacheStorage", "disk_cache_dir": str(tmp_path / "l3"),
             "durable": False, **extra}
    extra = {k: v for k, v in extra.items() if v is not None}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False,
                                  enable_storage_metrics=metrics, is_page_first_layout=False,
                                  model_name=model_name, dp_rank=dp_rank, extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, KVBackendHiCacheStorage)
    backend.register_mem_pool_host(pool)  # what the cache controller does next
    return backend


KEYS = [f"{i:064x}" for i in range(1, 6)]  # stand-ins for SGLang's page hash chain


def store(backend, pool, keys=KEYS):
    pages = [pool.get_data_page(i * PAGE) for i in range(len(keys))]
    assert backend.batch_set(keys, pages)
    return pages


def load(backend, pool, keys=KEYS):
    return backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])


def test_round_trip(tmp_path):
    pool = host_pool()
    backend = make_backend(tmp_path, pool)
    assert backend.batch_exists(KEYS) == 0
    pages = store(backend, pool)
    assert backend.batch_exists(KEYS) == len(KEYS)
    assert backend.batch_exists(KEYS[:2] + ["f" * 64] + KEYS[2:]) == 2
    for got, want in zip(load(backend, pool), pages):
        assert torch.equal(got, want)


def test_v1_round_trip(tmp_path):
    pool = host_pool()
    backend = make_backend(tmp_path, pool, interface_v1=1)
    src = torch.arange(0, 3 * PAGE)
    assert backend.batch_set_v1(KEYS[:3], src) == [True] * 3
    want = [pool.get_data_page(i * PAGE).clone() for i in range(3)]
    dst = torch.arange(8 * PAGE, 11 * PAGE)
    assert backend.batch_get_v1(KEYS[:3], dst) == [True] * 3
    for i in range(3):
        assert torch.equal(pool.get_data_page((8 + i) * PAGE), want[i])


def test_a_target_of_another_size_misses_and_keeps_the_page(tmp_path):
    pool = host_pool()
    backend = make_backend(tmp_path, pool)
    (page,) = store(backend, pool, KEYS[:1])
    assert backend.get(KEYS[0], torch.empty(page.numel() - 1, dtype=page.dtype)) is None
    assert torch.equal(load(backend, pool, KEYS[:1])[0], page)


def test_corrupted_file_is_a_miss_and_removed(tmp_path):
    pool = host_pool()
    backend = make_backend(tmp_path, pool)
    store(backend, pool)
    files = sorted(glob.glob(str(tmp_path / "l3" / "**" / "*.kvb"), recursive=True))
    assert len(files) == len(KEYS)
    victim = files[0]
    with open(victim, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\x00\xff")
    results = load(backend, pool)
    assert sum(r is None for r in results) == 1
    assert not os.path.exists(victim)


def test_other_model_identity_misses(tmp_path):
    pool = host_pool()
    store(make_backend(tmp_path, pool, model_name="tiny"), pool)
    other = make_backend(tmp_path, pool, model_name="tiny-v2")
    assert other.batch_exists(KEYS) == 0 and load(other, pool)[0] is None


def test_same_name_other_weights_miss(tmp_path):
    import numpy as np

    for name, seed in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        write_safetensors(tmp_path / name / "model.safetensors",
                          {"w": np.random.default_rng(seed).standard_normal(8)})
    pool = host_pool()
    first = make_backend(tmp_path, pool, model_path=str(tmp_path / "a"))
    store(first, pool)
    assert first.batch_exists(KEYS) == len(KEYS)
    assert make_backend(tmp_path, pool, model_path=str(tmp_path / "b")).batch_exists(KEYS) == 0


def test_other_dtype_misses(tmp_path):
    store(make_backend(tmp_path, host_pool(torch.bfloat16)), host_pool(torch.bfloat16))
    assert make_backend(tmp_path, host_pool(torch.float16)).batch_exists(KEYS) == 0


def test_other_salt_misses(tmp_path):
    pool = host_pool()
    store(make_backend(tmp_path, pool, namespace="tenant-a"), pool)
    assert make_backend(tmp_path, pool, namespace="tenant-b").batch_exists(KEYS) == 0
    assert make_backend(tmp_path, pool, namespace="tenant-a").batch_exists(KEYS) == len(KEYS)


def test_sglang_salted_keys_miss(tmp_path):
    """SGLang seeds the page hash chain with the request's salt: other keys, other files."""
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    pool = host_pool()
    backend = make_backend(tmp_path, pool)
    seeds = [storage_namespace_seed(None, salt) for salt in ("a", "b")]
    assert seeds[0] != seeds[1]
    backend.set(seeds[0], pool.get_data_page(0))
    assert backend.exists(seeds[0]) and not backend.exists(seeds[1])


def test_size_bound_evicts_lru(tmp_path):
    pool = host_pool()
    page_bytes = pool.get_data_page(0).numel() * 2 + 128
    backend = make_backend(tmp_path, pool, max_bytes=3 * page_bytes)
    store(backend, pool)
    assert backend.batch_exists(KEYS[-3:]) == 3
    assert not backend.exists(KEYS[0])
    backend.clear()
    assert backend.batch_exists(KEYS[-3:]) == 0


def test_stats_are_sglang_storage_metrics(tmp_path):
    """With --enable-metrics SGLang sets ``prefetch_stats`` on what get_stats() returns and
    logs it through StorageMetricsCollector, which asserts a StorageMetrics."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = host_pool()
    backend = make_backend(tmp_path, pool, metrics=True)
    store(backend, pool)
    load(backend, pool, KEYS[:2])
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [len(KEYS)] and stats.prefetch_pgs == [2]
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    stats.prefetch_stats = {}  # what UnifiedRadixCache does next
    assert backend.get_stats().prefetch_pgs == []  # each interval reports its own batches
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector
    StorageMetricsCollector({"storage_backend": "kvbackend"}).log_storage_metrics(stats)


def test_extra_pools_of_hybrid_models_are_refused_at_attach(tmp_path):
    """SGLang registers SWA / Mamba / DSA / MTP pools with register_mem_host_pool_v2 and
    then asks batch_exists_v2, which this backend does not serve: refuse the attach."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pool = host_pool()
    backend = make_backend(tmp_path, pool)
    backend.register_mem_host_pool_v2(pool, PoolName.KV)  # the anchor pool is fine
    with pytest.raises(ValueError, match="hybrid"):
        backend.register_mem_host_pool_v2(host_pool(), PoolName.SWA)


def test_dp_groups_share_pages(tmp_path):
    """Pages do not depend on the DP group (SGLang's own file backend shares them)."""
    pool = host_pool()
    store(make_backend(tmp_path, pool, dp_rank=0), pool)
    other = make_backend(tmp_path, pool, dp_rank=1)
    assert other.batch_exists(KEYS) == len(KEYS)
    for got, want in zip(load(other, pool), [pool.get_data_page(i * PAGE) for i in range(5)]):
        assert torch.equal(got, want)


def test_default_directory_is_per_user_not_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBACKEND_SGLANG_DISK_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    backend = make_backend(tmp_path, host_pool(), disk_cache_dir=None)
    assert backend.directory.startswith(str(tmp_path / "xdg" / "kvbackend"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    backend = make_backend(tmp_path, host_pool(), disk_cache_dir=None)
    assert backend.directory.startswith(str(tmp_path / "home" / ".cache" / "kvbackend"))
