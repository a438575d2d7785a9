"""kvbackend's state checkpoints for Mamba / linear-attention hybrids.

``StateCheckpoints`` against a plain model of it (hypothesis), then kvbackend's
scheduler with vLLM's real scheduler (its "align"-mode chunk splitting included) on the
``ContentWorker`` of ``async_harness.py`` with a state group, scheduling synchronously and
asynchronously: every request that resumes from a hit must find the state of exactly its
prefix in the state block it copies from.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from vllm.config import KVEventsConfig

from kvbackend.vllm.state_checkpoints import StateCheckpoints
from tests.vllm.async_harness import AsyncHarness, async_config
from tests.vllm.test_async_scheduling import HarnessMachine

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # physical: 12 logical blocks, one per group each


@given(ops=st.lists(st.tuples(st.sampled_from(["end", "forget", "drop"]),
                              st.lists(st.integers(1, 9), min_size=1, max_size=5),
                              st.integers(0, 24)), max_size=30))
def test_checkpoints_follow_step_ends_and_forget_reallocated_blocks(ops):
    """A block is a checkpoint iff the last step that ended on its last token came after
    it was last handed out and lost its state pages; a hit ends on the longest one."""
    checkpoints, model = StateCheckpoints(BLOCK_SIZE, 10), set()
    for op, table, end in ops:
        if op == "forget":
            checkpoints.forget(table)
            model -= set(table)
        elif op == "drop":  # its state pages went back
            assert checkpoints.drop(table[0]) == []  # no copy pending
            model.discard(table[0])
        elif end and end % BLOCK_SIZE == 0 and end <= len(table) * BLOCK_SIZE:
            checkpoints.add(table[end // BLOCK_SIZE - 1])
            model.add(table[end // BLOCK_SIZE - 1])
        checkpoints.check_invariants()
    assert {b for b in range(10) if checkpoints.holds(b)} == model
    table = ops[-1][1] if ops else [1]
    ends = [n for n in range(1, len(table) + 1) if table[n - 1] in model]
    assert checkpoints.longest_hit(table) == max(ends, default=0) * BLOCK_SIZE


@pytest.fixture(scope="module", params=["sync", "async"])
def state_config(tiny_model, request):
    config = async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                          max_num_seqs=3)
    config.scheduler_config.async_scheduling = request.param == "async"
    # KV events on (published nowhere): the stateful test checks what they announce.
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # Every group keeps a request's blocks: the longest request must fit the 11 usable.
    config.model_config.max_model_len = config.scheduler_config.max_model_len = 40
    return config


def test_a_request_whose_checkpoint_the_step_writes_waits_for_it(state_config):
    """A's first chunk ends on its checkpoint at 8 (vLLM's "align" split). B shares those
    8 tokens, but the workers copy B's state before the step writes A's: B is admitted
    one step later, as vLLM does, and resumes at 8."""
    harness = AsyncHarness(state_config, num_blocks=NUM_BLOCKS, state_layers=True)
    shared = list(range(1, 9))
    harness.add("a", shared + [30, 31, 32], max_tokens=2)
    harness.add("b", shared + [40, 41], max_tokens=2)
    out = harness.schedule()
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    harness.deliver()
    out = harness.schedule()
    assert {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs} == {"b": 8}
    harness.run_to_end()


def test_a_block_handed_out_again_is_no_checkpoint_until_a_step_ends_on_it(state_config):
    """A decoding request ends a step on each of its ten block boundaries, so every block
    it leaves in the tree is a checkpoint. A 19-token prompt then gets blocks evicted from
    it, and prefills 16 tokens in one chunk, ending on its fourth block only: a request
    sharing its first 12 tokens has no checkpoint to resume from, whatever its blocks
    held before."""
    harness = AsyncHarness(state_config, num_blocks=NUM_BLOCKS, state_layers=True)
    harness.add("decoder", [1, 2, 3], max_tokens=37)
    harness.run_to_end()
    manager = harness.scheduler.kv_cache_manager
    decoded = list(harness.requests["decoder"].all_token_ids)
    assert manager.cache.match(decoded).num_tokens == 39
    long_prompt = list(range(10, 29))
    harness.add("long", long_prompt, max_tokens=1)
    out = harness.schedule()
    assert dict(out.num_scheduled_tokens) == {"long": 16}
    harness.deliver()
    harness.run_to_end()
    harness.add("sharer", long_prompt[:12] + [40, 41], max_tokens=1)
    out = harness.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0
    harness.run_to_end()


def test_a_shared_prefix_without_a_checkpoint_gets_one_at_its_junction(state_config):
    """A prefills 16 tokens in one chunk: no checkpoint at 8. B shares A's first 10
    tokens; kvbackend names its junction (8, the shared whole blocks) and vLLM's scheduler
    ends B's first chunk there, so C, sharing the same 10 tokens, resumes at 8."""
    harness = AsyncHarness(state_config, num_blocks=NUM_BLOCKS, state_layers=True)
    shared = list(range(1, 11))
    harness.add("a", shared + list(range(30, 38)), max_tokens=1)
    harness.run_to_end()
    harness.add("b", shared + [40, 41, 42, 43, 44], max_tokens=1)
    out = harness.schedule()
    assert dict(out.num_scheduled_tokens) == {"b": 8}
    harness.run_to_end()
    harness.add("c", shared + [50, 51, 52], max_tokens=1)
    out = harness.schedule()
    assert {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs} == {"c": 8}
    harness.run_to_end()


def test_a_conversation_resumes_from_the_boundaries_its_decode_steps_ended_on(state_config):
    """A decode step ends on each block boundary it reaches; under async scheduling the
    block's last token is not sampled when the step is scheduled. The next turn, sent
    with the decoded tokens, still resumes at the last boundary they reach (12)."""
    harness = AsyncHarness(state_config, num_blocks=NUM_BLOCKS, state_layers=True)
    harness.add("turn1", [1, 2, 3], max_tokens=11)
    harness.run_to_end()
    decoded = list(harness.requests["turn1"].all_token_ids)
    harness.add("turn2", decoded + [40, 41], max_tokens=1)
    out = harness.schedule()
    assert {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs} == {
        "turn2": 12}
    harness.run_to_end()


def test_kvbackend_state_checkpoints_stateful(state_config):
    """Requests sharing prefixes in a pool of 12 blocks: chunks of up to four blocks (so
    most blocks hold no checkpoint), evictions that hand checkpointed blocks out again,
    aborts and preemptions."""

    class StateMachine(HarnessMachine):
        @initialize()
        def start(self):
            self.harness = AsyncHarness(state_config, num_blocks=NUM_BLOCKS,
                                        state_layers=True)

        @invariant()
        def structures_are_consistent(self):
            manager = self.harness.scheduler.kv_cache_manager
            manager.cache.check_invariants()
            manager.checkpoints.check_invariants()
            manager.states.check_invariants()  # state pages only where a reader needs them
            events = manager.kv_events
            events.check_invariants()  # a state page is announced iff its block holds one
            assert events.state_announced == {
                b for b in events.announced if manager.checkpoints.holds(b)}

    StateMachine.TestCase().runTest()
