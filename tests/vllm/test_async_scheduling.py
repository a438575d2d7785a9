"""kvbackend under vLLM's async scheduling: no request ever reads KV that is not there.

The engine core schedules step N+1 before step N's output is processed. The state
machine below interleaves arrivals with shared prefixes, chunked prefills (a
16-token budget), preemption (a pool of 10 blocks of 4 tokens), aborts, and the
two-deep batch queue, on vLLM's real ``AsyncScheduler`` machinery with kvbackend's
manager; ``ContentWorker`` (see ``async_harness.py``) executes each step in order
and fails on any read of a slot that does not hold the reader's own prefix.
After every step the manager's prefix cache passes ``check_invariants()``. A third of the
runs schedule synchronously (async scheduling off): the same checks for that scheduler.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from kvbackend.vllm import tier_transfer_config
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.scheduler import KVBackendScheduler, unsupported_features
from tests.vllm.async_harness import VOCAB, AsyncHarness, async_config

BLOCK_SIZE = 4
NUM_BLOCKS = 10
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 11, 12], [20, 21, 22])


@pytest.fixture(scope="module")
def config(tiny_model):
    return async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                        max_num_seqs=3)


def test_async_scheduling_builds_kvbackends_async_scheduler(config):
    harness = AsyncHarness(config, num_blocks=NUM_BLOCKS)
    assert isinstance(harness.scheduler, AsyncScheduler)
    assert isinstance(harness.scheduler, KVBackendScheduler)


def test_async_scheduling_with_tiers_is_refused(config):
    """Tier loads write device blocks outside the step order; kvbackend refuses the pair."""
    from vllm.config import KVTransferConfig

    with_tiers = copy.copy(config)
    with_tiers.kv_transfer_config = KVTransferConfig(
        **tier_transfer_config(KVBackendConfig.from_dict({"host_cache_gb": 1})))
    assert unsupported_features(config) == []
    assert unsupported_features(with_tiers) == [
        "async scheduling together with host/disk/remote tiers (pass --no-async-scheduling)"]


def test_a_shared_prefix_is_reused_under_async_scheduling(config):
    """B arrives while A's prefill is in flight and hits A's blocks (vLLM's own prefix
    caching would too), its partial block copied; the worker finds A's KV in them."""
    harness = AsyncHarness(config, num_blocks=NUM_BLOCKS)
    harness.add("a", PREFIXES[0] + [30, 31], max_tokens=3)  # 3 full blocks
    harness.schedule()
    harness.add("b", PREFIXES[0] + [32], max_tokens=3)
    out = harness.schedule()
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", len(PREFIXES[0]))
    while harness.in_flight or harness.scheduler.has_unfinished_requests():
        if harness.in_flight:
            harness.deliver()
        if harness.scheduler.has_unfinished_requests():
            harness.schedule()


def test_kvbackend_async_scheduling_stateful(config):
    """One machine for both schedulers: a third of the runs schedule synchronously."""
    sync_config = copy.deepcopy(config)
    sync_config.scheduler_config.async_scheduling = False

    class AsyncSchedulingMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.harness = None
            self.next_id = 0

        @initialize(mode=st.sampled_from(["async", "async", "sync"]))
        def start(self, mode):
            self.harness = AsyncHarness(config if mode == "async" else sync_config,
                                        num_blocks=NUM_BLOCKS)

        @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 10),
              suffix=st.lists(st.integers(0, VOCAB - 1), max_size=9),
              max_tokens=st.integers(1, 6))
        def arrive(self, prefix, cut, suffix, max_tokens):
            prompt = prefix[:cut] + suffix
            if prompt:
                self.harness.add(f"r{self.next_id}", prompt, max_tokens)
                self.next_id += 1

        @precondition(lambda self: len(self.harness.in_flight) < self.harness.max_in_flight)
        @rule()
        def schedule(self):
            self.harness.schedule()

        @precondition(lambda self: self.harness.in_flight)
        @rule()
        def deliver(self):
            self.harness.deliver()

        @precondition(lambda self: self.harness.scheduler.requests)
        @rule(data=st.data())
        def abort(self, data):
            live = sorted(self.harness.scheduler.requests)
            self.harness.abort(data.draw(st.sampled_from(live)))

        @invariant()
        def cache_is_consistent(self):
            self.harness.scheduler.kv_cache_manager.cache.check_invariants()

    AsyncSchedulingMachine.TestCase().runTest()
