"""``BlockEvents`` under any order of device stores and reuses, tier copies (host,
disk, remote; disk-to-host prefetches), tier drops and resets: its invariants hold
after every step, and a router that replays the events it published holds exactly
what the device and each tier hold."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.request import Request

from kvbackend.vllm.kv_events import DISK, HOST, REMOTE, BlockEvents
from tests.vllm.test_kv_events import held_by_tier

BLOCK_SIZE = 4
NUM_BLOCKS = 3
blocks = st.integers(0, NUM_BLOCKS - 1)
tiers = st.sampled_from([HOST, DISK, REMOTE])


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
        self.copies: dict[tuple, bool] = {}  # (tier, block) a tier holds -> announced yet

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
        for copy in self.copies:
            if copy[1] == block:
                self.copies[copy] = True

    @rule(block=blocks)
    def device_reuse(self, block: int) -> None:
        self.events.reused([block])
        self.device.discard(block)
        for copy in [c for c, shown in self.copies.items() if c[1] == block and not shown]:
            del self.copies[copy]  # waited for this block: never announced

    @rule(tier=tiers, block=blocks)
    def tier_put(self, tier, block: int) -> None:
        self.events.tier_stored(tier, f"k{block}", block)
        self.copies.setdefault((tier, block), block in self.device)

    @rule(data=st.data())
    def disk_to_host_prefetch(self, data) -> None:
        """A copy of a disk block (mostly one the disk holds): held (and shown) as the
        disk's copy is; none when the disk's copy is unknown here (another process
        wrote it)."""
        on_disk = sorted(b for t, b in self.copies if t == DISK)
        block = data.draw(st.sampled_from(on_disk) if on_disk and data.draw(st.booleans())
                          else blocks)
        self.events.tier_copied(DISK, HOST, f"k{block}")
        if (DISK, block) in self.copies:
            self.copies.setdefault((HOST, block), self.copies[DISK, block])

    @rule(tier=tiers, block=blocks)
    def tier_drop(self, tier, block: int) -> None:
        self.events.tier_removed(tier, f"k{block}")
        self.copies.pop((tier, block), None)

    @rule(tier=tiers)
    def tier_clear(self, tier) -> None:
        self.events.tier_cleared(tier)
        self.copies = {c: shown for c, shown in self.copies.items() if c[0] != tier}

    @rule()
    def device_clear(self) -> None:
        self.events.cleared()
        self.device.clear()

    @invariant()
    def router_sees_what_is_held(self) -> None:
        self.events.check_invariants()
        self._take()
        held = held_by_tier(self.published)
        assert held.get((MEDIUM_GPU, None), set()) == {self.hashes[b] for b in self.device}
        for tier in (HOST, DISK, REMOTE):
            assert held.get(tier, set()) == {self.hashes[b] for (t, b), shown
                                             in self.copies.items() if t == tier and shown}


TestBlockEvents = BlockEventsMachine.TestCase
