"""RemoteWriter against a real server: write-behind, skip what is there, drop rather than wait."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test,
)

from kvbackend.store.remote_tier import RemoteTier
from kvbackend.store.remote_writer import RemoteWriter
from kvbackend.testing.redis_server import RedisServer
from tests.redis_server import require_binary, server  # noqa: F401 - a fixture
from tests.store_helpers import key_of, make_identity, payload_for

ID = make_identity()
BLOCK = 4096


def batch(first: int, n: int, salt: str = ""):
    return [(key_of(i, salt), payload_for(key_of(i, salt), BLOCK), 16)
            for i in range(first, first + n)]


def test_blocks_arrive_and_present_ones_are_not_sent_again(server):
    server.client().flushall()
    tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK,), timeout_s=5)
    writer = RemoteWriter(tier, 1 << 20)
    assert writer.submit(batch(0, 4)) and writer.flush(10)
    assert tier.contains_many([k for k, _, _ in batch(0, 4)]) == 4
    assert writer.submit(batch(2, 4)) and writer.flush(10)  # 2 and 3 are there already
    stats = writer.stats()
    assert (stats["sent"], stats["skipped_present"], stats["queued_bytes"]) == (6, 2, 0)
    assert [bytes(p) for p in tier.get_many([k for k, _, _ in batch(0, 6)])] == [
        p for _, p, _ in batch(0, 6)]
    writer.close()


def test_a_paused_server_never_makes_submit_wait_and_a_full_queue_drops(tmp_path):
    with RedisServer(require_binary(), tmp_path) as server:
        tier = RemoteTier(server.url, ID, payload_sizes=(BLOCK,), timeout_s=1.0)
        writer = RemoteWriter(tier, 4 * BLOCK)
        server.pause()
        start = time.monotonic()
        accepted = [writer.submit(batch(i, 1)) for i in range(8)]
        assert time.monotonic() - start < 0.5
        assert accepted == [True] * 4 + [False] * 4  # the one being sent counts too
        assert writer.stats()["dropped"] == accepted.count(False)
        writer.check_invariants()
        assert writer.flush(10)  # the paused server: one timeout, then the breaker
        server.resume()
        assert writer.stats()["failed"] == accepted.count(True)
        writer.close()


class WriterMachine(RuleBasedStateMachine):
    """Submits and flushes in any order; after a flush, every accepted block is on the
    server, byte for byte."""

    server: RedisServer  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.server.client().flushall()
        self.tier = RemoteTier(self.server.url, ID, payload_sizes=(BLOCK,), timeout_s=5)
        self.writer = RemoteWriter(self.tier, 6 * BLOCK)
        self.accepted: set[str] = set()
        self.next = 0

    @rule(n=st.integers(0, 4), repeat=st.booleans())
    def submit(self, n: int, repeat: bool) -> None:
        first = max(0, self.next - n) if repeat else self.next
        blocks = batch(first, n, "m")
        if self.writer.submit(blocks):
            self.accepted.update(k for k, _, _ in blocks)
        self.next = max(self.next, first + n)

    @precondition(lambda self: self.accepted)
    @rule()
    def flush(self) -> None:
        assert self.writer.flush(10)
        keys = sorted(self.accepted)
        got = self.tier.get_many(keys)
        assert [bytes(p) if p is not None else None for p in got] == [
            payload_for(k, BLOCK) for k in keys]

    @invariant()
    def invariants(self) -> None:
        self.writer.check_invariants()

    def teardown(self) -> None:
        self.writer.close()


def test_writer_state_machine(server):
    WriterMachine.server = server
    run_state_machine_as_test(WriterMachine, settings=settings(
        max_examples=40, stateful_step_count=12, deadline=None))  # a real server: fewer
