"""``BlockEvents`` under any order of device stores and reuses, tier copies, tier
drops and resets: its invariants hold after every step, and a router that replays
the events it published holds exactly what the device and the host tier hold."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU
from vllm.v1.request import Request

from kvbackend.vllm.kv_events import BlockEvents
from tests.vllm.test_kv_events import held_by_medium

BLOCK_SIZE = 4
NUM_BLOCKS = 3
blocks = st.integers(0, NUM_BLOCKS - 1)


class BlockEventsMachine(RuleBasedStateMachine):
    """One request fills device blocks ``0 .. NUM_BLOCKS - 1`` (block ``i`` holds the
    request's ``i``-th block of tokens, so it always hashes alike) and tier key
    ``k<i>`` names block ``i``'s content."""

    def __init__(self) -> None:
        super().__init__()
        tokens = list(range(10, 10 + BLOCK_SIZE * NUM_BLOCKS))
        self.request = Request("r", tokens, SamplingParams(max_tokens=1), None)
        self.tokens = self.request.all_token_ids
        self.events = BlockEvents("sha256", BLOCK_SIZE)
        self.published: list = []
        self.hashes: dict[int, int] = {}  # block -> its announced hash, once seen
        self.device: set[int] = set()  # blocks announced, not reused since
        self.host: dict[int, bool] = {}  # block whose copy the host holds -> announced yet

    def _take(self) -> None:
        self.published += self.events.take()

    @rule(block=blocks)
    def device_store(self, block: int) -> None:
        import numpy as np
        self.events.stored(self.request, np.array(self.tokens), list(range(NUM_BLOCKS)),
                           block, block + 1)
        self._take()
        self.hashes.setdefault(block, self.published[-1].block_hashes[0]
                               if block not in self.device else self.hashes[block])
        self.device.add(block)
        if block in self.host:
            self.host[block] = True

    @rule(block=blocks)
    def device_reuse(self, block: int) -> None:
        self.events.reused([block])
        self.device.discard(block)
        if self.host.get(block) is False:  # waited for this block: never announced
            del self.host[block]

    @rule(block=blocks)
    def host_put(self, block: int) -> None:
        self.events.tier_stored(f"k{block}", block, MEDIUM_CPU)
        self.host.setdefault(block, block in self.device)

    @rule(block=blocks)
    def host_drop(self, block: int) -> None:
        self.events.tier_removed(f"k{block}")
        self.host.pop(block, None)

    @rule()
    def host_clear(self) -> None:
        self.events.tier_cleared(MEDIUM_CPU)
        self.host.clear()

    @rule()
    def device_clear(self) -> None:
        self.events.cleared()
        self.device.clear()

    @invariant()
    def router_sees_what_is_held(self) -> None:
        self.events.check_invariants()
        self._take()
        held = held_by_medium(self.published)
        assert held.get(MEDIUM_GPU, set()) == {self.hashes[b] for b in self.device}
        assert held.get(MEDIUM_CPU, set()) == {self.hashes[b] for b, shown in self.host.items()
                                               if shown}


TestBlockEvents = BlockEventsMachine.TestCase
