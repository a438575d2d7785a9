"""kvbackend under vLLM's priority scheduling policy (``--scheduling-policy priority``).

Under it vLLM preempts the running request of lowest priority when another cannot get
blocks, and that may be a request already scheduled in the same step: vLLM then takes it
out of the step, so the tokens it was scheduled for are never computed. The state machine
drives kvbackend's scheduler (synchronous and async) with vLLM's real priority queue and
preemption, requests of mixed priorities sharing prefixes in a small pool, on the
``ContentWorker`` of ``async_harness.py``: every read must find its own prefix, and every
slot the prefix tree publishes must hold its prefix after every step.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from tests.vllm.async_harness import VOCAB, AsyncHarness, async_config
from tests.vllm.test_async_scheduling import PREFIXES, HarnessMachine

BLOCK_SIZE = 4
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def priority_config(tiny_model):
    config = async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                          max_num_seqs=3)
    config.scheduler_config.policy = "priority"
    config.scheduler_config.long_prefill_token_threshold = 8  # prefills share steps
    return config


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_request_preempted_out_of_the_step_that_scheduled_it_publishes_only_what_ran(
        priority_config, mode):
    """LOW's third prefill chunk (tokens 24..31) is scheduled, then HIGH cannot grow and
    vLLM preempts LOW, the lowest priority, out of that step: those tokens never run.
    ``schedule`` checks every published slot: publishing LOW's chunk when it was
    scheduled left the block of its tokens 24..27 in the tree, never written (HIGH's
    eviction took the block of 28..31 only)."""
    config = copy.deepcopy(priority_config)
    config.scheduler_config.async_scheduling = mode == "async"
    harness = AsyncHarness(config, num_blocks=NUM_BLOCKS)
    harness.add("low", list(range(1, 33)), max_tokens=4, priority=2)
    harness.schedule()  # LOW alone: tokens 0..15
    harness.deliver()
    harness.add("mid", [40, 41, 42], max_tokens=30, priority=1)
    harness.add("high", list(range(50, 66)), max_tokens=4, priority=0)
    out = harness.schedule()  # LOW 16..23; HIGH admitted, 0..7 (blocks reserved for LOW)
    assert dict(out.num_scheduled_tokens) == {"low": 8, "high": 8}
    if mode == "sync":
        harness.deliver()
    out = harness.schedule()  # LOW 24..31 scheduled, then preempted for HIGH's 8..15
    assert out.preempted_req_ids == {"low"}
    assert dict(out.num_scheduled_tokens) == {"high": 8}
    manager = harness.scheduler.kv_cache_manager
    assert manager.cache.match(list(range(1, 33))).num_tokens == 24
    harness.run_to_end()


def test_kvbackend_priority_scheduling_stateful(priority_config):
    sync_config = copy.deepcopy(priority_config)
    sync_config.scheduler_config.async_scheduling = False

    class PriorityMachine(HarnessMachine):
        @initialize(mode=st.sampled_from(["async", "sync"]))
        def start(self, mode):
            self.top_priority = 0
            self.harness = AsyncHarness(priority_config if mode == "async" else sync_config,
                                        num_blocks=NUM_BLOCKS)

        @rule(prefix=st.sampled_from(PREFIXES), cut=st.just(10) | st.integers(0, 10),
              suffix=st.lists(st.integers(0, VOCAB - 1), max_size=30),
              max_tokens=st.integers(1, 16), urgent=st.booleans())
        def arrive_with_priority(self, prefix, cut, suffix, max_tokens, urgent):
            """An urgent request outranks every earlier one: admitted after them, it
            preempts them when it cannot grow, in the steps that scheduled them too."""
            prompt = prefix[:cut] + suffix
            if prompt:
                self.top_priority -= urgent
                self.harness.add(f"r{self.next_id}", prompt, max_tokens,
                                 self.top_priority if urgent else self.top_priority + 1)
                self.next_id += 1

        @invariant()
        def cache_is_consistent(self):
            self.harness.scheduler.kv_cache_manager.cache.check_invariants()

    PriorityMachine.TestCase().runTest()
