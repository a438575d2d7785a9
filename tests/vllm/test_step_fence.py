"""``StepFence`` against a model: a block is busy exactly while a step that may use it
has not run, and counting stays in step order."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.vllm.step_fence import StepFence

NUM_BLOCKS = 8


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fence = StepFence(NUM_BLOCKS, track=True)
        self.last_use = [0] * NUM_BLOCKS  # the model: the last step each block may be used in
        self.scheduled = self.processed = 0

    @rule()
    def schedule(self):
        self.fence.step_scheduled()
        self.scheduled += 1

    @precondition(lambda self: self.processed < self.scheduled)
    @rule()
    def process(self):
        self.fence.step_processed()
        self.processed += 1

    @rule(blocks=st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4),
          in_current=st.booleans())
    def use(self, blocks, in_current):
        """A request freed (its blocks used up to the last step handed out), or a copy
        taken in the step being scheduled."""
        step = self.fence.next_step if in_current else self.fence.scheduled
        self.fence.used(blocks, step)
        for b in blocks:
            self.last_use[b] = max(self.last_use[b], step)

    @invariant()
    def busy_blocks_are_those_a_step_in_flight_may_use(self):
        expected = [b for b in range(NUM_BLOCKS) if self.last_use[b] > self.processed]
        assert self.fence.busy(range(NUM_BLOCKS)) == expected
        assert all(self.fence.has_run(s) == (s <= self.processed)
                   for s in range(self.scheduled + 2))
        self.fence.check_invariants()


TestStepFence = FenceMachine.TestCase


def test_an_output_for_a_step_never_scheduled_is_a_bug():
    with pytest.raises(RuntimeError, match="never scheduled"):
        StepFence(NUM_BLOCKS, track=True).step_processed()


def test_without_tracking_nothing_is_busy():
    fence = StepFence(NUM_BLOCKS, track=False)
    fence.step_scheduled()
    fence.used([1, 2], fence.scheduled)
    assert fence.busy([1, 2]) == []
