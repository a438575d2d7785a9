"""Stateful property test of the tier planner serving a Mamba / linear-attention hybrid
("State checkpoints" in ``kvbackend/vllm/tiers/planner.py``): ``TierPlannerMachine``
with two KV-cache groups, a state group (0) and an attention group (1), and two real
ranks whose workers move both groups' pages of a tier block.

The model of the forward pass adds the state: a step over tokens [begin, end) starts
from the state after ``begin`` (the initial one at 0; at a block boundary the state
page of the block ending there; inside a block the state the request carried) and
leaves the state after ``end`` in the state page of the block holding token
``end - 1``: the state after that block's last token only when ``end`` is on its
boundary, else a state no hit may resume from. A step on a wrong state computes
garbage in every layer. vLLM takes a failed load of such a model as a failed request
(recomputed from its first token).

Checked besides the base machine's invariants: every checkpoint copy in a host or disk
tier holds both the state after its block's last token and the block's attention KV,
and every ordinary copy the attention KV alone (half the bytes: the host mirror weighs
copies by size); a hit's last block loads a checkpoint copy; every running request
resumes from the right state.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from kvbackend.store import checkpoint_key
from tests.test_tier_planner_stateful import (
    BS, GARBAGE, NUM_BLOCKS, ROW, SimRequest, TierPlannerMachine, expected,
)


def expected_state(key: str, rank: int) -> np.ndarray:
    """The state after the last token of block ``key`` on ``rank``."""
    return expected(f"state/{key}", rank)


class HybridTierPlannerMachine(TierPlannerMachine):
    GROUPS = 2
    STATE_GROUPS = (0,)
    NUM_BLOCKS = 2 * NUM_BLOCKS + 1  # block 0 is vLLM's null block: never allocated

    def __init__(self) -> None:
        super().__init__()
        self.free = list(range(1, self.NUM_BLOCKS))
        self.state_ids: dict[str, list[int]] = {}  # request -> its state group's blocks
        self.carried: dict[str, bool] = {}  # request -> its state inside a block is right
        self.checkpoint_of: dict[str, str] = {}  # checkpoint key -> its block's key

    # ---------------------------------------------------------------- hooks
    def keys(self, tokens: list[int], num_blocks: int) -> list[str]:
        keys = super().keys(tokens, num_blocks)
        for key in keys:
            self.checkpoint_of.setdefault(checkpoint_key(key), key)
        return keys

    def release(self, request: SimRequest) -> None:
        self.free.extend(self.state_ids.pop(request.request_id, []))
        super().release(request)

    def allocate(self, request: SimRequest, need: int) -> bool:
        if len(self.free) < 2 * need or not super().allocate(request, need):
            return False
        self.state_ids[request.request_id] = [self.free.pop() for _ in range(need)]
        return True

    def physical(self, request: SimRequest) -> list[tuple[int, ...]]:
        return list(zip(self.state_ids.get(request.request_id, []), request.block_ids))

    def device_hit_written(self, request: SimRequest, keys: list[str], device_hit: int) -> None:
        super().device_hit_written(request, keys, device_hit)
        if device_hit:  # a device hit ends on a block holding a checkpoint (the manager's)
            j = device_hit // BS - 1
            for r in self.ranks:
                r.write(self.state_ids[request.request_id][j], expected_state(keys[j], r.rank))

    def adoptions(self, hit_blocks: int):
        return st.sampled_from([0, hit_blocks])  # fewer fails every block: tested alone

    def loaded_keys(self, hit_keys: list[str]) -> list[str]:
        return [*hit_keys[:-1], checkpoint_key(hit_keys[-1])] if hit_keys else []

    def recompute_from(self, failed_blocks: list[int]) -> int:
        return 0

    def payload_is_right(self, key: str, rank: int, payload: np.ndarray) -> bool:
        block = self.checkpoint_of.get(key)
        if block is None:  # an ordinary copy: the attention page alone
            return bool(np.array_equal(payload, expected(key, rank)))
        return bool(np.array_equal(payload[:ROW], expected_state(block, rank))
                    and np.array_equal(payload[ROW:], expected(block, rank)))

    def compute(self, request: SimRequest, begin: int, end: int, inputs_ok: bool = True) -> None:
        rid, states = request.request_id, self.state_ids[request.request_id]
        keys = self.keys(request.tokens, -(-end // BS))
        state_ok = self.state_is_right(request, begin, keys)
        super().compute(request, begin, end, inputs_ok and state_ok)
        last = (end - 1) // BS
        if end % BS:  # the state inside block ``last``: carried to the next step only
            self.carried[rid] = request.partial_ok
            for r in self.ranks:
                r.write(states[last], GARBAGE)
        else:
            right = all(r.holds(request.block_ids[last], keys[last]) for r in self.ranks)
            for r in self.ranks:
                r.write(states[last], expected_state(keys[last], r.rank) if right else GARBAGE)

    # ---------------------------------------------------------------- helpers
    def state_is_right(self, request: SimRequest, at: int, keys: list[str]) -> bool:
        """Whether the state ``request`` resumes from at token ``at`` is right on every rank."""
        if at == 0:
            return True
        if at % BS:
            return self.carried.get(request.request_id, False)
        page = self.state_ids[request.request_id][at // BS - 1]
        return all(np.array_equal(r.cache[page].numpy(), expected_state(keys[at // BS - 1], r.rank))
                   for r in self.ranks)

    # ------------------------------------------------------------- invariants
    @invariant()
    def running_requests_resume_from_the_right_state(self) -> None:
        for request in self.requests.values():
            if request.running and request.num_computed < len(request.tokens):
                keys = self.keys(request.tokens, request.num_computed // BS)
                assert self.state_is_right(request, request.num_computed, keys), (
                    f"{request.request_id} would resume from a wrong state at "
                    f"{request.num_computed}")


HybridTierPlannerMachine.TestCase.settings = settings(
    HybridTierPlannerMachine.TestCase.settings, stateful_step_count=30)
TestHybridTierPlanner = HybridTierPlannerMachine.TestCase
