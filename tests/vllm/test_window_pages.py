"""kvbackend frees the sliding-window pages no window reaches, on vLLM's real scheduler.

A model with a full-attention group and a sliding-window group (``AsyncHarness`` with
``window``; a 6-token window over 4-token blocks): a block keeps its sliding-window
page while a live request's window reaches it, then while the pool has room.
``ContentWorker`` writes every token in both groups and reads the window group only
inside each query's window, failing on any slot that does not hold the reader's own
prefix; ``check_published`` checks every window page a published block still has.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from kvbackend.vllm.block_groups import PagedBlockGroups
from tests.vllm.async_harness import AsyncHarness, async_config, tier_gb
from tests.vllm.test_async_scheduling import HarnessMachine, TieredMachine, with_tiers

BLOCK_SIZE, WINDOW = 4, 6
NUM_BLOCKS = 24  # pages of either group: 23 usable, the null block aside
MAX_MODEL_LEN = 48  # 12 full-attention blocks and at most 6 window pages (16-token chunks)


@pytest.fixture(scope="module")
def config(tiny_model):
    config = async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                          max_num_seqs=3)
    config.model_config.max_model_len = config.scheduler_config.max_model_len = MAX_MODEL_LEN
    return config


def harness_for(config, mode: str) -> AsyncHarness:
    chosen = copy.deepcopy(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    return AsyncHarness(chosen, num_blocks=NUM_BLOCKS, window=WINDOW)


def tiered(config, mode: str):
    """``config`` with kvbackend's tier connector, scheduling as ``mode`` says."""
    chosen = with_tiers(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    chosen.scheduler_config.disable_hybrid_kv_cache_manager = False  # SupportsHMA
    return chosen


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_request_longer_than_every_groups_blocks_runs_in_a_window(config, mode):
    """44 tokens take 11 blocks in each group, 22 with both: more than half the pool.
    Each step frees the window pages its request's window left, so the request runs
    alone holding its 11 full-attention blocks and at most 6 window pages, and the pages
    it left stay cached (idle) until the pool needs them."""
    harness = harness_for(config, mode)
    manager = harness.scheduler.kv_cache_manager
    assert isinstance(manager.groups, PagedBlockGroups)
    harness.add("long", list(range(1, 33)), max_tokens=12)
    peak = 0
    while harness.scheduler.has_unfinished_requests() or harness.in_flight:
        if harness.in_flight and (len(harness.in_flight) == harness.max_in_flight
                                  or not harness.scheduler.has_unfinished_requests()):
            harness.deliver()
        else:
            harness.schedule()
        held = manager.cache.block_counts().held - manager.windows.num_idle
        peak = max(peak, held)
        manager.windows.check_invariants()
    assert harness.requests["long"].num_output_tokens == 12
    assert peak <= 11 + 6
    assert manager.windows.num_idle > 0


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_hit_stops_where_its_last_window_lost_its_pages(config, mode):
    """a's 44 tokens are cached; its first blocks' window pages turned idle while it ran,
    before its last chunks used its path. b then needs more than the free blocks: those
    pages go first (least recently used), then a's tail. d continues all of a that is
    cached and hits it all (its last window's pages are there). c shares the longest
    prefix of a whose full-attention blocks are cached but whose window reads a block
    without pages: it hits only up to where every block of its window still has them.
    c recomputes the rest, and the tree takes c's blocks (which have their pages) for
    those tokens, so e, sharing as much, hits at least their whole blocks. Every read is
    checked."""
    harness = harness_for(config, mode)
    manager = harness.scheduler.kv_cache_manager
    a = list(range(1, 45))
    harness.add("a", a, max_tokens=1)
    harness.run_to_end()
    harness.add("b", list(range(50, 66)), max_tokens=1)
    harness.run_to_end()
    windows = manager.windows
    cached = manager.cache.match(a, touch=False)
    assert windows.longest_hit(cached.block_ids, cached.num_tokens) == cached.num_tokens > 20
    hits = manager.hit_tokens
    harness.add("d", a + [95], max_tokens=1)
    harness.run_to_end()
    assert manager.hit_tokens - hits == cached.num_tokens
    cached = manager.cache.match(a, touch=False)
    cut = [h for h in range(1, cached.num_tokens + 1)
           if windows.longest_hit(cached.block_ids, h) < h]
    assert cut, "b took none of a's idle window pages"
    hit = windows.longest_hit(cached.block_ids, cut[-1])
    assert hit % BLOCK_SIZE == 0
    hits = manager.hit_tokens
    harness.add("c", a[:cut[-1]] + [90, 91], max_tokens=2)
    harness.run_to_end()
    assert manager.hit_tokens - hits == hit
    hits = manager.hit_tokens  # c recomputed those tokens: the tree took its blocks
    harness.add("e", a[:cut[-1]] + [92, 93], max_tokens=2)
    harness.run_to_end()
    assert manager.hit_tokens - hits >= cut[-1] // BLOCK_SIZE * BLOCK_SIZE > hit


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_recomputed_block_that_nodes_share_is_adopted(config, mode):
    """Block 2 holds the end of a shared 10-token prefix S and the start of branch X,
    which wrote it first (a second branch, Y, copied it): the tree's S and X nodes both
    list it. Later traffic takes the window pages of S + X's blocks, but not the blocks.
    A request continuing S + X hits none of it (no window page left), recomputes it,
    and the tree takes its blocks, block 2 included, for both nodes; so the next one
    continuing S + X hits all 16 tokens, as vLLM's prefix caching would (before, block
    2 stayed without pages: a hit of 8). Every read is checked."""
    harness = harness_for(config, mode)
    manager = harness.scheduler.kv_cache_manager
    shared, x, y, tail = range(1, 11), range(11, 17), range(21, 27), range(30, 42)
    path = [*shared, *x]

    def hit(request_id: str, prompt: list[int]) -> int:
        before = manager.hit_tokens
        harness.add(request_id, prompt, max_tokens=1)
        harness.run_to_end()
        return manager.hit_tokens - before

    assert hit("x", path) == 0 and hit("y", [*shared, *y]) == len(shared)
    assert hit("x2", [*path, *tail]) == 16 and hit("x3", [*path, *tail, 43, 44]) == 28
    for k in range(4):  # the pages go first: the blocks' last use is recent
        hit(f"other{k}", [44 + k, *range(30, 33 + 2 * k)])
    cached = manager.cache.match(path, touch=False)
    assert cached.num_tokens == 16 and not manager.windows.has_pages(cached.block_ids[2])
    assert hit("x4", [*path, 40, 41]) < 16
    assert hit("x5", [*path, 42, 43]) == 16


def test_every_read_and_published_window_page_is_exact_stateful(config):
    """The async scheduling machine on the model with a sliding-window group: arrivals
    sharing prefixes, chunked prefills, preemption, aborts, one or two steps in flight;
    after every step the cache's and the window pages' invariants hold."""

    class WindowMachine(HarnessMachine):
        @initialize(mode=st.sampled_from(["async", "async", "sync"]))
        def start(self, mode):
            self.harness = harness_for(config, mode)

        @invariant()
        def cache_and_windows_are_consistent(self):
            manager = self.harness.scheduler.kv_cache_manager
            manager.cache.check_invariants()
            manager.windows.check_invariants()

    WindowMachine.TestCase().runTest()



@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_tier_hit_loads_its_window_in_every_group_and_the_rest_in_full_attention(
        config, mode, tmp_path):
    """With kvbackend's host tier the sliding-window pages are still freed: a's 44 tokens
    are saved whole (every group's block, while its window held them), then the device
    forgets them. b continues a: its tier hit loads all 11 blocks, but only the blocks
    its window reads (from token 39 on: blocks 9 and 10) get pages, into which the load
    writes the sliding-window group's KV; blocks 0-8 get the full-attention KV only.
    Every read of both groups is checked, and b's published tokens stop where pages
    stop: a hit after them is cut back to what its window still has."""
    harness = AsyncHarness(tiered(config, mode), num_blocks=NUM_BLOCKS, window=WINDOW, tiers={
        "host_cache_gb": tier_gb(config, 2 * 12), "disk_cache_dir": str(tmp_path)})
    manager = harness.scheduler.kv_cache_manager
    assert isinstance(manager.groups, PagedBlockGroups)
    a = list(range(1, 45))
    harness.add("a", a, max_tokens=1)
    harness.run_to_end()
    assert manager.reset_prefix_cache()
    harness.add("b", a + [95], max_tokens=2)
    harness.schedule()
    seq = manager._requests["b"].sequence
    assert [manager.windows.has_pages(b) for b in seq.block_ids[:11]] == [False] * 9 + [True] * 2
    starts = []  # b is scheduled once its load (asynchronous: several groups) is in
    while harness.scheduler.has_unfinished_requests() or harness.in_flight:
        if harness.in_flight:
            harness.deliver()
        else:
            starts += [new.num_computed_tokens for new in harness.schedule().scheduled_new_reqs]
    assert starts == [44]  # every block from the host tier
    assert harness.scheduler.connector.planner.check_invariants() is None
    manager.windows.check_invariants()


def test_every_read_of_tier_loads_in_both_groups_is_exact_stateful(config):
    """The tiered machine of ``test_async_scheduling`` on the model with a sliding-window
    group: host and disk tiers, device cache dropped, disk files damaged; every read of
    both groups is checked, and the window pages' invariants hold after every step."""
    configs = {mode: tiered(config, mode) for mode in ("async", "sync")}

    class TieredWindowMachine(TieredMachine):
        @initialize(mode=st.sampled_from(["async", "async", "sync"]), seed=st.integers(0, 99))
        def start(self, mode, seed):
            self.begin(configs[mode], NUM_BLOCKS, seed, window=WINDOW)

        @invariant()
        def windows_are_consistent(self):
            self.harness.scheduler.kv_cache_manager.windows.check_invariants()

    TieredWindowMachine.TestCase.settings = settings(TieredWindowMachine.TestCase.settings,
                                                     max_examples=40, stateful_step_count=30)
    TieredWindowMachine.TestCase().runTest()
