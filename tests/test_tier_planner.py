"""The tier planner's answers to what vLLM's normal call order never produces (the
stateful test in test_tier_planner_stateful.py covers that order), and its host mirror."""

from __future__ import annotations

import pytest

from kvbackend.vllm.tiers.host_mirror import HostMirror
from kvbackend.vllm.tiers.messages import ScheduledRequest
from kvbackend.vllm.tiers.planner import TierPlanner

BS = 4
DIGEST = "ab" * 32


def test_tokens_adopted_without_a_lookup_fail_and_their_saves_wait():
    """vLLM adopting tier tokens that no lookup offered (a bug, or an error the connector
    caught) must not leave KV that no load fills counted as computed: every block is
    reported failed, so vLLM recomputes, and nothing computed on it in that step is saved."""
    planner = TierPlanner(BS, DIGEST, host_capacity=8, disk_contains=None)
    tokens = list(range(3, 3 + 4 * BS + 1))
    assert planner.lookup("r", tokens, b"", 0) == 0
    planner.allocated("r", [7, 8, 9, 10, 11], 2 * BS)
    orders = planner.plan_step([ScheduledRequest("r", 2 * BS, 2 * BS + 1, [7, 8, 9, 10, 11])])
    assert orders.failed == (7, 8, 9, 10, 11)
    assert not orders.loads and not orders.saves
    planner.step_finished({7, 8, 9, 10, 11})  # vLLM recomputes from block 0
    orders = planner.plan_step([ScheduledRequest("r", 0, 4 * BS + 1, [7, 8, 9, 10, 11])])
    assert [o.block_id for o in orders.saves] == [7, 8, 9, 10]
    planner.check_invariants()


def test_a_mirror_full_of_pinned_keys_refuses_inserts():
    mirror = HostMirror(2)
    for key in ("a", "b"):
        mirror.insert(key)
        mirror.pin(key)
    assert mirror.insert("c") == (False, ())
    mirror.unpin("a")
    assert mirror.insert("c") == (True, ("a",))
    assert mirror.keys() == ["b", "c"]
    mirror.check_invariants()
    with pytest.raises(RuntimeError, match="not pinned"):
        mirror.unpin("a")
