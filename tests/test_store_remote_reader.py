"""RemoteReader against a real server: loads leave the caller at once, every batch comes back
once, a paused server costs the thread one timeout and never the caller."""

from __future__ import annotations

import time

import pytest

from kvbackend.store.remote_reader import RemoteReader
from kvbackend.store.remote_tier import RemoteTier
from kvbackend.testing.redis_server import RedisServer
from tests.redis_server import require_binary, server  # noqa: F401 - a fixture
from tests.store_helpers import key_of, make_identity, payload_for

ID = make_identity()
BLOCK = 4096


def wait_done(reader: RemoteReader, count: int, timeout_s: float = 20) -> list:
    done, deadline = [], time.monotonic() + timeout_s
    while len(done) < count and time.monotonic() < deadline:
        done += reader.take_done()
        reader.check_invariants()
        time.sleep(0.01)
    return done


def test_batches_come_back_once_with_verified_payloads(server):
    tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK,), timeout_s=5)
    keys = [key_of(i, "reader") for i in range(4)]
    assert tier.put_many([(k, payload_for(k, BLOCK), 16) for k in keys[:3]]) == 3
    reader = RemoteReader(tier)
    reader.submit("a", keys[:2])
    reader.submit("b", keys[2:])
    done = {tag: payloads for tag, payloads, _ in wait_done(reader, 2)}
    assert [bytes(p) for p in done["a"]] == [payload_for(k, BLOCK) for k in keys[:2]]
    assert bytes(done["b"][0]) == payload_for(keys[2], BLOCK) and done["b"][1] is None
    assert reader.pending() == 0 and reader.take_done() == []
    reader.close()
    reader.submit("late", keys)  # after close: back at once, all misses
    assert reader.take_done() == [("late", [None] * 4, 0.0)]


def test_a_paused_server_never_makes_the_caller_wait(tmp_path):
    with RedisServer(require_binary(), tmp_path) as server:
        tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK,), timeout_s=1.0)
        keys = [key_of(i, "paused") for i in range(3)]
        assert tier.put_many([(k, payload_for(k, BLOCK), 16) for k in keys]) == 3
        reader = RemoteReader(tier)
        server.pause()
        try:
            start = time.monotonic()
            for i, key in enumerate(keys):
                reader.submit(i, [key])
            assert reader.take_done() == [] and time.monotonic() - start < 0.5
            reader.check_invariants()
            done = wait_done(reader, 3)  # one timeout, then the breaker answers at once
            assert sorted(tag for tag, _, _ in done) == [0, 1, 2]
            assert all(payloads == [None] for _, payloads, _ in done)
            assert time.monotonic() - start < 5
        finally:
            server.resume()
        reader.close()


def test_close_hands_back_the_queued_batches_as_misses(tmp_path):
    with RedisServer(require_binary(), tmp_path) as server:
        tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK,), timeout_s=1.0)
        reader = RemoteReader(tier)
        server.pause()
        try:
            for i in range(3):
                reader.submit(i, [key_of(i)])
            reader.close(timeout_s=5)
        finally:
            server.resume()
        done = wait_done(reader, 3)
        assert sorted(tag for tag, _, _ in done) == [0, 1, 2]
        assert all(payloads == [None] for _, payloads, _ in done)
        reader.check_invariants()
