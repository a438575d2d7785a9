"""``StatePages``: which blocks of a hybrid keep state pages, on a small ``PrefixCache``.

Logical blocks here are the caller's blocks of the cache (a table's blocks behave alike
for the pages); every call is followed by ``check_invariants``.
"""

from __future__ import annotations

from kvbackend.core import PrefixCache
from kvbackend.vllm.state_checkpoints import StateCheckpoints
from kvbackend.vllm.state_pages import StatePages

BLOCK_SIZE = 4


def _state_pages(num_blocks: int = 32) -> tuple[StatePages, list[int]]:
    cache = PrefixCache(num_blocks, BLOCK_SIZE)
    removed: list[int] = []
    pages = StatePages(cache, 1, StateCheckpoints(BLOCK_SIZE, num_blocks), removed.append)
    return pages, removed


def _blocks(pages: StatePages, n: int) -> list[int]:
    return pages.cache.allocate_blocks(n)


def test_a_request_keeps_the_block_its_previous_step_ended_in_until_its_next_step():
    """The workers copy a request's state out of the block its previous step ended in
    before the forward pass, in parallel with every other copy: a page let go of earlier
    could be handed to another request's copy in that very step."""
    pages, _ = _state_pages()
    hit, first, second = _blocks(pages, 3)
    pages.checkpoints.add(hit)
    pages.give("other", [hit], _blocks(pages, 1))
    pages.release("other")  # a cached checkpoint: idle
    pages.hold("r", [hit])  # admitted on it
    pages.give("r", [first], _blocks(pages, 1))  # its first step ends in `first`
    pages.check_invariants()
    pages.advance("r", second, _blocks(pages, 1))  # reads `first`, writes `second`
    pages.check_invariants()
    assert pages.pages.has_pages(first) and pages.pages.is_held(first)
    assert pages.pages.has_pages(hit) and not pages.pages.is_held(hit)  # idle again
    pages.advance("r", second)  # a step within `second`: no copy, `first` goes back
    pages.check_invariants()
    assert not pages.pages.has_pages(first) and pages.pages.is_held(second)
    pages.release("r")
    pages.check_invariants()
    assert not pages.pages.has_pages(second) and pages.pages.num_idle == 1


def test_a_checkpoint_whose_pages_go_back_is_forgotten_with_its_pending_copies():
    """A junction copy gives the tree's block idle pages; if its source's pages go back
    before the copy ran (its request aborted, the pool took them), the copy is dropped and
    the destination, no checkpoint after all, gives its pages back."""
    pages, removed = _state_pages()
    own, shared = _blocks(pages, 2)
    checkpoints = pages.checkpoints
    pages.give("b", [own], _blocks(pages, 1))
    checkpoints.add(own)
    assert pages.copy_into(own, shared) and checkpoints.holds(shared)
    pages.check_invariants()
    assert pages.pages.has_pages(shared) and not pages.pages.is_held(shared)
    pages.release("b")  # `own` turns idle (a checkpoint)
    pages.cache.free_blocks([own])  # and leaves the pool: its pages with it
    pages.check_invariants()
    assert not checkpoints.holds(own) and not checkpoints.holds(shared)
    assert checkpoints.take_copies() == [] and not pages.pages.has_pages(shared)
    assert sorted(removed) == sorted([own, shared])


def test_a_junction_copy_is_skipped_when_the_pool_has_no_room():
    pages, _ = _state_pages(num_blocks=4)
    own, shared = _blocks(pages, 2)
    pages.give("b", [own], _blocks(pages, 1))
    pages.checkpoints.add(own)
    assert pages.copy_into(own, shared) is None
    assert not pages.checkpoints.holds(shared) and not pages.pages.has_pages(shared)
    pages.check_invariants()
