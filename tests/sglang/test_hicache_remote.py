"""KVBackendHiCacheStorage on the remote tier (``remote_cache_url``), against a real Redis/Valkey
server that the test starts: two instances share pages through it, with the same keys and
checks as the vLLM remote tier; a corrupted value, another model, another salt: misses; a
paused server: misses and failed backups, never an error; bad password files are refused."""

import pytest

pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvbackend.store.block_file import HEADER_LEN  # noqa: E402
from kvbackend.testing.redis_server import RedisServer  # noqa: E402
from tests.redis_server import require_binary, server  # noqa: E402,F401 - a fixture
from tests.sglang.test_hicache_storage import (  # noqa: E402
    KEYS, PAGE, host_pool, load, make_backend, store,
)


def remote_backend(tmp_path, pool, url, **extra):
    return make_backend(tmp_path, pool, disk_cache_dir=None, remote_cache_url=url, **extra)


def test_a_second_instance_finds_the_pages_of_the_first(tmp_path, server):
    server.client().flushall()
    pool = host_pool()
    pages = store(remote_backend(tmp_path, pool, server.url), pool)
    assert not (tmp_path / "l3").exists()  # nothing on disk
    other = remote_backend(tmp_path, pool, server.url)  # another instance, same model
    assert other.batch_exists(KEYS) == len(KEYS)
    assert other.batch_exists(KEYS[:2] + ["f" * 64] + KEYS[2:]) == 2
    for got, want in zip(load(other, pool), pages):
        assert torch.equal(got, want)
    names = sorted(n.decode() for n in server.client().scan_iter("kvb:v2:*"))
    digest = other.tier.identity_digest
    assert names == sorted(f"kvb:v2:{digest}:{other._key(k)}" for k in KEYS)  # vLLM's layout


def test_v1_pages_go_through_the_server(tmp_path, server):
    server.client().flushall()
    pool = host_pool()
    backend = remote_backend(tmp_path, pool, server.url, interface_v1=1)
    assert backend.batch_set_v1(KEYS[:3], torch.arange(0, 3 * PAGE)) == [True] * 3
    want = [pool.get_data_page(i * PAGE).clone() for i in range(3)]
    assert backend.batch_get_v1(KEYS[:3], torch.arange(8 * PAGE, 11 * PAGE)) == [True] * 3
    for i in range(3):
        assert torch.equal(pool.get_data_page((8 + i) * PAGE), want[i])


def test_a_corrupted_value_is_a_miss_and_deleted(tmp_path, server):
    server.client().flushall()
    pool = host_pool()
    backend = remote_backend(tmp_path, pool, server.url)
    store(backend, pool)
    raw = server.client()
    victim = f"kvb:v2:{backend.tier.identity_digest}:{backend._key(KEYS[1])}"
    value = bytearray(raw.get(victim))
    value[HEADER_LEN + 1] ^= 0xFF
    raw.set(victim, bytes(value))
    results = load(backend, pool)
    assert [r is None for r in results] == [False, True, False, False, False]
    assert not raw.exists(victim)


def test_another_model_or_salt_misses(tmp_path, server):
    server.client().flushall()
    pool = host_pool()
    store(remote_backend(tmp_path, pool, server.url, namespace="tenant-a"), pool)
    for extra in (dict(namespace="tenant-b"), dict(namespace="tenant-a", model_name="tiny-v2")):
        other = remote_backend(tmp_path, pool, server.url, **extra)
        assert other.batch_exists(KEYS) == 0 and load(other, pool)[0] is None
    float16_pool = host_pool(torch.float16)
    assert remote_backend(tmp_path, float16_pool, server.url,
                          namespace="tenant-a").batch_exists(KEYS) == 0


def test_a_paused_server_is_a_miss_and_a_failed_backup(tmp_path):
    with RedisServer(require_binary(), tmp_path / "redis") as paused:
        pool = host_pool()
        backend = remote_backend(tmp_path, pool, paused.url)
        store(backend, pool)
        paused.pause()
        try:
            start = time.monotonic()
            assert backend.batch_exists(KEYS) == 0  # one timeout, then the breaker
            assert load(backend, pool) == [None] * len(KEYS)
            assert not backend.batch_set(KEYS, [pool.get_data_page(0)] * len(KEYS))
            assert time.monotonic() - start < 5
        finally:
            paused.resume()


def test_bad_password_files_are_refused(tmp_path, server):
    pool = host_pool()
    with pytest.raises(ValueError, match="cannot read password file"):
        remote_backend(tmp_path, pool, server.url,
                       remote_cache_password_file=str(tmp_path / "missing"))
    shared = tmp_path / "pw"
    shared.write_text("s3cret\n")
    os.chmod(shared, 0o644)
    with pytest.raises(ValueError, match="chmod 600") as error:
        remote_backend(tmp_path, pool, server.url, remote_cache_password_file=str(shared))
    assert "s3cret" not in str(error.value)


def test_a_password_file_reaches_the_server(tmp_path):
    (tmp_path / "pw").write_text("pa ss\n")
    os.chmod(tmp_path / "pw", 0o600)
    with RedisServer(require_binary(), tmp_path / "redis", password="pa ss") as locked:
        pool = host_pool()
        url = f"redis://127.0.0.1:{locked.port}/0"
        backend = remote_backend(tmp_path, pool, url,
                                 remote_cache_password_file=str(tmp_path / "pw"))
        store(backend, pool)
        assert backend.batch_exists(KEYS) == len(KEYS)
        assert remote_backend(tmp_path, pool, url).batch_exists(KEYS) == 0  # NOAUTH: a miss
