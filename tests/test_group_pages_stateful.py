"""``GroupPages`` against a plain model of it (hypothesis, stateful).

Logical blocks are the caller's blocks of a small ``PrefixCache``; each gets pages in
two further groups, is held and released, is kept idle or not (``keep_idle``), and
the pool takes idle pages back, longest idle first, when an allocation falls short.
After every step: ``check_invariants``, and the model's blocks with pages, holds, and
freed pages (``on_freed`` / ``on_dropped``) are exactly the structure's.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.core import PrefixCache
from kvbackend.core.group_pages import GroupPages

NUM_GROUPS = 2


class GroupPagesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(24, 4)
        self.kept: set[int] = set()  # blocks keep_idle says to keep
        self.freed: list[int] = []
        self.dropped: list[int] = []
        self.pages = GroupPages(self.cache, NUM_GROUPS, on_dropped=self.dropped.append,
                                keep_idle=self.kept.__contains__, on_freed=self.freed.append)
        self.blocks: list[int] = []  # logical blocks (the caller's), with or without pages
        self.held: dict[int, int] = {}  # model: block -> holds (present: it has pages)
        self.idle: list[int] = []  # model: idle blocks, longest idle first
        self.pages_freed: list[int] = []  # model: blocks whose pages went back, in order

    def _pages_back(self, block: int) -> None:
        del self.held[block]
        if block in self.idle:
            self.idle.remove(block)
        self.pages_freed.append(block)

    @rule(keep=st.booleans())
    def new_block_with_pages(self, keep):
        blocks = self.cache.allocate_blocks(1 + NUM_GROUPS)
        if blocks is None:
            assert self.cache.num_allocatable_blocks < 1 + NUM_GROUPS
            return
        reclaimed = [b for b in self.dropped if b in self.held]
        for b in reclaimed:  # the allocation took idle pages back, longest idle first
            assert self.idle[0] == b
            self._pages_back(b)
        self.dropped.clear()
        block, pages = blocks[0], blocks[1:]
        if keep:
            self.kept.add(block)
        self.pages.give([block], pages)
        self.blocks.append(block)
        self.held[block] = 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def hold(self, data):
        block = data.draw(st.sampled_from(sorted(self.held)))
        self.pages.hold([block])
        self.held[block] += 1
        if block in self.idle:
            self.idle.remove(block)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def unhold(self, data):
        block = data.draw(st.sampled_from(sorted(b for b, n in self.held.items() if n)))
        self.pages.unhold([block])
        self.held[block] -= 1
        if not self.held[block]:
            if block in self.kept:
                self.idle.append(block)
            else:
                self._pages_back(block)

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def stop_keeping(self, data):
        block = data.draw(st.sampled_from(self.idle))
        self.kept.discard(block)
        self.pages.discard_idle(block)
        self._pages_back(block)

    @precondition(lambda self: any(not self.held.get(b) for b in self.blocks))
    @rule(data=st.data())
    def free_block(self, data):
        block = data.draw(st.sampled_from([b for b in self.blocks if not self.held.get(b)]))
        had_pages = block in self.held
        self.cache.free_blocks([block])  # its pages go with it
        self.blocks.remove(block)
        self.kept.discard(block)
        if had_pages:
            self._pages_back(block)

    @invariant()
    def matches_the_model(self):
        self.pages.check_invariants()
        self.cache.pool.check_invariants()
        assert {b for b in self.blocks if self.pages.has_pages(b)} == set(self.held)
        assert {b for b in self.held if self.pages.is_held(b)} == {
            b for b, n in self.held.items() if n}
        assert self.pages.num_idle == len(self.idle)
        assert self.pages.num_reclaimable == NUM_GROUPS * len(self.idle)
        assert self.freed == self.pages_freed


TestGroupPages = GroupPagesMachine.TestCase
