"""``BlockEvents`` under any order of device stores and reuses, tier copies (host,
disk, remote; disk-to-host prefetches), tier drops and resets, and for a hybrid's
state group state checkpoints: its invariants hold after every step, and a router
that replays the events it published holds exactly what the device and each tier
hold, in each KV-cache group."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.request import Request

from kvbackend.vllm.kv_events import DISK, HOST, REMOTE, BlockEvents, EventGroup
from tests.vllm.test_kv_events import held_by_tier

BLOCK_SIZE = 4
NUM_BLOCKS = 3
blocks = st.integers(0, NUM_BLOCKS - 1)
tiers = st.sampled_from([HOST, DISK, REMOTE])


class BlockEventsMachine(RuleBasedStateMachine):
    """One request fills device blocks ``0 .. NUM_BLOCKS - 1`` (block ``i`` holds the
    request's ``i``-th block of tokens, so it always hashes alike) and tier key
    ``k<i>`` names block ``i``'s content. One full-attention group."""

    groups = (EventGroup("full_attention"),)

    def __init__(self) -> None:
        super().__init__()
        tokens = list(range(10, 10 + BLOCK_SIZE * NUM_BLOCKS))
        self.request = Request("r", tokens, SamplingParams(max_tokens=1), None)
        self.tokens = self.request.all_token_ids
        self.events = BlockEvents("sha256", BLOCK_SIZE, self.groups)
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

    def in_group(self, group: int) -> list:
        """The events published so far that concern KV-cache group ``group``."""
        return [e for e in self.published if getattr(e, "group_idx", group) == group]

    @invariant()
    def router_sees_what_is_held(self) -> None:
        self.events.check_invariants()
        self._take()
        assert all(getattr(e, "group_idx", 0) == 0 for e in self.published)
        held = held_by_tier(self.in_group(0))
        assert held.get((MEDIUM_GPU, None), set()) == {self.hashes[b] for b in self.device}
        for tier in (HOST, DISK, REMOTE):
            assert held.get(tier, set()) == {self.hashes[b] for (t, b), shown
                                             in self.copies.items() if t == tier and shown}


TestBlockEvents = BlockEventsMachine.TestCase


class HybridBlockEventsMachine(BlockEventsMachine):
    """As above with a hybrid's two groups, attention (0) and state (1): a device
    block's state page is announced in group 1 exactly while it holds a checkpoint
    (written since the block was last handed out, cleared or lost its state pages) and
    is announced."""

    groups = (EventGroup("full_attention"), EventGroup("mamba", holds_state=True))

    def __init__(self) -> None:
        super().__init__()
        self.checkpoints: set[int] = set()

    @rule(block=blocks)
    def state_checkpoint(self, block: int) -> None:
        self.events.state_written(block)
        self.checkpoints.add(block)

    @rule(block=blocks)
    def state_pages_freed(self, block: int) -> None:
        """The block's state pages went back (``StatePages``); it stays cached."""
        self.events.state_removed(block)
        self.checkpoints.discard(block)

    @rule(block=blocks)
    def device_reuse(self, block: int) -> None:
        super().device_reuse(block)
        self.checkpoints.discard(block)

    @rule()
    def device_clear(self) -> None:
        super().device_clear()
        self.checkpoints.clear()

    @invariant()
    def router_sees_what_is_held(self) -> None:
        self.events.check_invariants()
        self._take()
        attention = held_by_tier(self.in_group(0))
        assert attention.get((MEDIUM_GPU, None), set()) == {self.hashes[b] for b in self.device}
        for tier in (HOST, DISK, REMOTE):  # tier copies hold attention KV only
            assert attention.get(tier, set()) == {self.hashes[b] for (t, b), shown
                                                  in self.copies.items() if t == tier and shown}
        state = held_by_tier(self.in_group(1))
        assert set(state) <= {(MEDIUM_GPU, None)}
        assert state.get((MEDIUM_GPU, None), set()) == {
            self.hashes[b] for b in self.device & self.checkpoints}


TestHybridBlockEvents = HybridBlockEventsMachine.TestCase


class WindowedBlockEventsMachine(BlockEventsMachine):
    """As above with a full-attention group (0) and a sliding-window group (1) whose pages
    are freed once out of every window: a device block is held in group 1 while it is
    announced and its window pages were not freed since it was stored."""

    groups = (EventGroup("full_attention"), EventGroup("sliding_window", sliding_window=8))

    def __init__(self) -> None:
        super().__init__()
        self.windowed: set[int] = set()  # announced blocks that still have window pages

    @rule(block=blocks)
    def device_store(self, block: int) -> None:
        announced = block in self.device
        super().device_store(block)
        if not announced:
            self.windowed.add(block)

    @rule(block=blocks)
    def window_pages_freed(self, block: int) -> None:
        self.events.window_removed(block)
        self.windowed.discard(block)

    @rule(block=blocks)
    def device_reuse(self, block: int) -> None:
        super().device_reuse(block)
        self.windowed.discard(block)

    @rule()
    def device_clear(self) -> None:
        super().device_clear()
        self.windowed.clear()

    @invariant()
    def router_sees_what_is_held(self) -> None:
        self.events.check_invariants()
        self._take()
        full, window = held_by_tier(self.in_group(0)), held_by_tier(self.in_group(1))
        assert full.get((MEDIUM_GPU, None), set()) == {self.hashes[b] for b in self.device}
        assert window.get((MEDIUM_GPU, None), set()) == {
            self.hashes[b] for b in self.device & self.windowed}


TestWindowedBlockEvents = WindowedBlockEventsMachine.TestCase
