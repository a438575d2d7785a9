"""kvbackend under vLLM's async scheduling: no request ever reads KV that is not there.

The engine core schedules step N+1 before step N's output is processed. The state
machine below interleaves arrivals with shared prefixes, chunked prefills (a
16-token budget), preemption (a pool of 10 blocks of 4 tokens), aborts, and the
two-deep batch queue, on vLLM's real ``AsyncScheduler`` machinery with kvbackend's
manager; ``ContentWorker`` (see ``async_harness.py``) executes each step in order
and fails on any read of a slot that does not hold the reader's own prefix.
After every step the manager's prefix cache passes ``check_invariants()``. A third of the
runs schedule synchronously (async scheduling off): the same checks for that scheduler.
With a draft model's 3 draft tokens per decode step, of which the worker accepts a random
number, the scheduler runs ahead of the worker's valid KV by the rejected drafts until
each step's output is in: no request reads a rejected draft's slot, and the tree holds
only real tokens.

With kvbackend's host and disk tiers (real ``TierPlanner`` and host mirror in the
scheduler, real ``TierWorker``/``HostTier``/``DiskTier`` moving the worker's KV tensor),
requests finish into the tiers, the device cache is dropped now and then so prompts
load from host or disk, and disk files are damaged behind the planner's back, so
loads fail. On top of the reads above, every step checks that every slot the prefix
tree publishes holds its prefix (no block of a failed load is ever published), the
planner's invariants, and that its host mirror equals the worker's host tier.
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from vllm.config import KVTransferConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from kvbackend.testing.tiny_model import build_tiny_llama
from kvbackend.vllm import tier_transfer_config
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.scheduler import KVBackendScheduler, unsupported_features
from tests.store_helpers import damage_file, tree_files
from tests.vllm.async_harness import VOCAB, AsyncHarness, async_config, tier_gb
from tests.vllm.spec_decode_steps import leaf_paths

BLOCK_SIZE = 4
NUM_BLOCKS = 10
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 11, 12], [20, 21, 22])


@pytest.fixture(scope="module")
def spec_config(tiny_model, tmp_path_factory):
    """``config`` with a draft model proposing 3 tokens per step (and 3 lookahead slots)."""
    draft = build_tiny_llama(str(tmp_path_factory.mktemp("tiny-draft")), seed=1)
    return async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                        max_num_seqs=3, speculative_config={
                            "method": "draft_model", "model": draft,
                            "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def config(tiny_model):
    return async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                        max_num_seqs=3)


def test_async_scheduling_builds_kvbackends_async_scheduler(config):
    harness = AsyncHarness(config, num_blocks=NUM_BLOCKS)
    assert isinstance(harness.scheduler, AsyncScheduler)
    assert isinstance(harness.scheduler, KVBackendScheduler)


def with_tiers(config):
    """``config`` with kvbackend's tier connector selected (settings: ``AsyncHarness``)."""
    config = copy.deepcopy(config)
    config.kv_transfer_config = KVTransferConfig(
        **tier_transfer_config(KVBackendConfig.from_dict({"host_cache_gb": 1})))
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # as vLLM sets it
    return config


def damage_a_disk_file(root: str, pick: int, rot: bool) -> None:
    """Another process evicts a block file, or it rots: its next load fails."""
    paths = tree_files(root, ".kvb")
    if paths:
        damage_file(paths[pick % len(paths)], rot)


def failing_tier_load(config, root: str) -> AsyncHarness:
    """A harness whose next admission of ``B_PROMPT`` loads A's block 0 from a rotted disk
    file (its load fails; host has no room left to promote it but an unpinned key of D's)
    and blocks 1 and 2 from host."""
    tiered = with_tiers(config)
    harness = AsyncHarness(tiered, num_blocks=NUM_BLOCKS, tiers={
        "host_cache_gb": tier_gb(tiered, 3), "disk_cache_dir": root})
    harness.add("a", PREFIXES[0] + [30, 31], max_tokens=1)  # 3 full blocks, all in host
    harness.run_to_end()
    harness.add("d", [40, 41, 42, 43, 44], max_tokens=1)  # evicts A's block 0 from host
    harness.run_to_end()
    assert harness.scheduler.kv_cache_manager.reset_prefix_cache()
    for i in range(len(tree_files(root, ".kvb"))):
        damage_a_disk_file(root, i, rot=True)
    return harness


B_PROMPT = PREFIXES[0] + [30, 31, 32]


def test_a_failed_tier_load_under_async_scheduling_leaves_the_host_mirror(config, tmp_path):
    """B waits while its load step N runs; step N+1 is planned before step N's failure
    report arrives, which still takes block 0's key out of the host mirror; B is
    recomputed from block 0, and no step reads, nor the tree lists, the failed block."""
    harness = failing_tier_load(config, str(tmp_path))
    harness.add("b", B_PROMPT, max_tokens=2)
    out = harness.schedule()  # step N: B's loads; B waits for their report
    assert not out.num_scheduled_tokens and len(out.kv_connector_metadata.orders.loads) == 3
    assert out.kv_connector_metadata.orders.loads[0].promote
    harness.add("c", [50, 51, 52], max_tokens=2)
    harness.schedule()  # step N+1, planned before step N's report
    harness.deliver()  # step N's report: block 0 failed
    harness.run_to_end()
    assert harness.host_mirror_is_the_host_tier(), "block 0's key stayed in the host mirror"
    assert harness.requests["b"].num_output_tokens == 2


def test_a_request_aborted_while_its_tier_load_runs_publishes_none_of_it(config, tmp_path):
    """vLLM frees B once its load step reports, without cutting its computed tokens back
    to the failed block (it is no longer waiting): nothing of B may be published then."""
    harness = failing_tier_load(config, str(tmp_path))
    harness.add("b", B_PROMPT, max_tokens=2)
    harness.schedule()
    harness.abort("b")
    harness.deliver()  # checks every published slot
    harness.add("e", B_PROMPT, max_tokens=2)  # loads again: the host blocks, then computes
    harness.run_to_end()


def test_async_scheduling_with_tiers_is_served_without_deferred_frees(config, tmp_path):
    """vLLM would defer block frees for the tier connector (its kv_role loads); its loads
    run in step order, so kvbackend's async scheduler frees at once, and every tier hit
    loads asynchronously (the request waits for its load step's output)."""
    tiered = with_tiers(config)
    assert unsupported_features(tiered) == []
    harness = AsyncHarness(tiered, num_blocks=NUM_BLOCKS, tiers={
        "host_cache_gb": tier_gb(tiered, 2), "disk_cache_dir": str(tmp_path)})
    assert harness.scheduler.defer_block_free is False
    assert harness.scheduler.connector.planner.all_loads_async


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_request_is_not_starved_by_blocks_its_own_cached_path_holds(config, mode):
    """r2 continues r1's prompt, which ends inside a block that r2 copied (they are
    admitted together); r0 branches off inside block 1. Alone at the end, r2 needs 8 of
    the 9 blocks, while its cached path held 9: its own copies plus r1's block 2 and the
    block r0's branch shares with the path. It was preempted, then never admitted again
    (unfinished after 200 steps); the path now gives up the blocks its copies replace."""
    chosen = copy.deepcopy(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    harness = AsyncHarness(chosen, num_blocks=NUM_BLOCKS)
    harness.add("r0", PREFIXES[1], max_tokens=1)
    harness.add("r1", PREFIXES[0], max_tokens=1)
    harness.add("r2", PREFIXES[0] + [0] * 8, max_tokens=12)
    harness.run_to_end()
    assert harness.requests["r2"].num_preemptions == 0
    harness.scheduler.kv_cache_manager.cache.check_invariants()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_partial_hit_on_a_block_its_writer_appends_to_is_not_cut_back(config, mode):
    """a's prompt ends inside block 1 and a decodes into that block in the step that
    admits b, whose prompt is a's plus its own tokens: the step writes block 1 from slot
    2 on, b copies slots 0 and 1, which an earlier step wrote. b hits all 6 tokens (it was
    cut back to the 4 of block 0), and the worker checks every slot b reads."""
    chosen = copy.deepcopy(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    harness = AsyncHarness(chosen, num_blocks=NUM_BLOCKS)
    prompt = PREFIXES[0][:6]
    harness.add("a", prompt, max_tokens=4)
    harness.schedule()  # a's prefill
    if mode == "sync":
        harness.deliver()
    harness.add("b", prompt + [VOCAB - 1, VOCAB - 2], max_tokens=2)
    manager = harness.scheduler.kv_cache_manager
    out = harness.schedule()  # a writes position 6 (block 1, slot 2); b is admitted
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert manager.hit_tokens == 6
    harness.run_to_end()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_prefix_gives_up_its_block_once_a_continuation_copied_it(config, mode):
    """r1's 10 tokens end inside block 2; r2 continues them, copying that block. From the
    next step on the tree lists r2's copy for r1's tokens too, and r1's own block is
    free: the cached tokens take one block per 4 (one more before)."""
    chosen = copy.deepcopy(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    harness = AsyncHarness(chosen, num_blocks=NUM_BLOCKS)
    harness.add("r1", PREFIXES[0], max_tokens=1)
    harness.run_to_end()
    harness.add("r2", PREFIXES[0] + [0] * 6, max_tokens=1)
    harness.run_to_end()
    harness.schedule()  # the next step starts (empty here)
    harness.deliver()
    cache = harness.scheduler.kv_cache_manager.cache
    assert cache.match(PREFIXES[0] + [0] * 6).num_tokens == 16  # r2's 16 computed tokens
    cached = {int(b) for node in cache.tree.iter_nodes(all_namespaces=True)
              for b in node.block_ids}
    assert len(cached) == 16 // BLOCK_SIZE
    assert cache.pool.num_free == NUM_BLOCKS - 1 - len(cached)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_hit_never_copies_a_block_another_copy_fills_in_the_same_step(config, mode):
    """r1's 10 tokens end inside block 2. a and c continue them in one step: a copies
    r1's block 2 into its own; then (as when the pool falls short while c is admitted)
    r1's prefix takes a's copy. c's hit ends on that copy's first slots, which the step's
    copy fills: vLLM runs a step's copies all at once (every source read first), so c
    must not copy from it (its hit is cut back to the full blocks); the worker checks
    every slot c reads."""
    chosen = copy.deepcopy(config)
    chosen.scheduler_config.async_scheduling = mode == "async"
    harness = AsyncHarness(chosen, num_blocks=NUM_BLOCKS)
    harness.add("r1", PREFIXES[0], max_tokens=1)
    harness.run_to_end()
    harness.schedule()  # a step without requests: the next steps start clean
    harness.deliver()
    manager = harness.scheduler.kv_cache_manager
    lookup = manager.get_computed_blocks

    def lookup_after_a_drop(request):
        if request.request_id == "c":
            manager.get_computed_blocks = lookup
            manager._publish_scheduled()  # a's continuation, which copied block 2
            assert manager.cache.drop_redundant_copies() == 0  # r1's block 2: a's copy source
        return lookup(request)

    manager.get_computed_blocks = lookup_after_a_drop
    harness.add("a", PREFIXES[0] + [30, 31], max_tokens=1)
    harness.add("c", PREFIXES[0] + [40, 41], max_tokens=1)
    hits = manager.hit_tokens
    out = harness.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "c"}
    assert manager.hit_tokens - hits == 10 + 8
    harness.run_to_end()


def test_a_shared_prefix_is_reused_under_async_scheduling(config):
    """B arrives while A's prefill is in flight and hits A's blocks (vLLM's own prefix
    caching would too), its partial block copied; the worker finds A's KV in them."""
    harness = AsyncHarness(config, num_blocks=NUM_BLOCKS)
    harness.add("a", PREFIXES[0] + [30, 31], max_tokens=3)  # 3 full blocks
    harness.schedule()
    harness.add("b", PREFIXES[0] + [32], max_tokens=3)
    out = harness.schedule()
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", len(PREFIXES[0]))
    while harness.in_flight or harness.scheduler.has_unfinished_requests():
        if harness.in_flight:
            harness.deliver()
        if harness.scheduler.has_unfinished_requests():
            harness.schedule()


class HarnessMachine(RuleBasedStateMachine):
    """Requests arriving with shared prefixes, steps scheduled (up to the harness's steps
    in flight), outputs delivered, aborts; subclasses start ``self.harness``."""

    def __init__(self) -> None:
        super().__init__()
        self.harness: AsyncHarness | None = None
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.just(10) | st.integers(0, 10),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=9),
          max_tokens=st.integers(1, 12))
    def arrive(self, prefix, cut, suffix, max_tokens):
        prompt = prefix[:cut] + suffix
        if prompt:
            self.harness.add(f"r{self.next_id}", prompt, max_tokens)
            self.next_id += 1

    @precondition(lambda self: len(self.harness.in_flight) < self.harness.max_in_flight)
    @rule()
    def schedule(self):
        self.harness.schedule()

    @precondition(lambda self: self.harness.in_flight)
    @rule()
    def deliver(self):
        self.harness.deliver()

    # vLLM's engine core takes aborts between its steps: synchronously, only once the
    # step's output is in (a synchronous tier load is published after that output).
    @precondition(lambda self: self.harness.scheduler.requests and (
        self.harness.max_in_flight > 1 or not self.harness.in_flight))
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.harness.scheduler.requests)
        self.harness.abort(data.draw(st.sampled_from(live)))


def test_kvbackend_async_scheduling_stateful(config):
    """One machine for both schedulers: a third of the runs schedule synchronously."""
    sync_config = copy.deepcopy(config)
    sync_config.scheduler_config.async_scheduling = False

    class AsyncSchedulingMachine(HarnessMachine):
        @initialize(mode=st.sampled_from(["async", "async", "sync"]))
        def start(self, mode):
            self.harness = AsyncHarness(config if mode == "async" else sync_config,
                                        num_blocks=NUM_BLOCKS)

        @invariant()
        def cache_is_consistent(self):
            self.harness.scheduler.kv_cache_manager.cache.check_invariants()

    AsyncSchedulingMachine.TestCase().runTest()


def test_a_conversation_decoded_with_draft_tokens_is_reused_under_async_scheduling(
        spec_config):
    """A request decodes with drafts (some rejected: their slots hold ``GARBAGE``), then
    its conversation continues: the next turn hits every token the first one computed,
    output included, and reads only valid KV."""
    harness = AsyncHarness(copy.deepcopy(spec_config), num_blocks=NUM_BLOCKS, seed=1)
    harness.add("a", PREFIXES[0], max_tokens=12)
    harness.run_to_end()
    worker, manager = harness.worker, harness.scheduler.kv_cache_manager
    assert 0 < worker.accepted < worker.drafts
    turn = list(harness.requests["a"].all_token_ids)
    assert len(turn) == len(PREFIXES[0]) + 12
    hits = manager.hit_tokens
    harness.add("b", turn + [30, 31], max_tokens=4)
    harness.run_to_end()
    # All of a's tokens whose KV a step wrote: the last one too if a step ran after it.
    assert manager.hit_tokens - hits >= len(turn) - 1


def test_kvbackend_async_scheduling_with_draft_tokens_stateful(spec_config):
    """The machine above with a draft model's 3 draft tokens per decode step, of which the
    model accepts a random number: under async scheduling the scheduler counts a step's
    drafts as computed until the step's output says how many were rejected, and the
    worker writes the next step from where its KV is valid. No request reads a rejected
    draft's KV, nor KV of a step that has not run, and the tree holds only real tokens."""
    sync_config = copy.deepcopy(spec_config)
    sync_config.scheduler_config.async_scheduling = False

    class DraftMachine(HarnessMachine):
        @initialize(mode=st.sampled_from(["async", "async", "sync"]), seed=st.integers(0, 99))
        def start(self, mode, seed):
            self.harness = AsyncHarness(spec_config if mode == "async" else sync_config,
                                        num_blocks=NUM_BLOCKS, seed=seed)

        @invariant()
        def cache_holds_real_tokens_only(self):
            cache = self.harness.scheduler.kv_cache_manager.cache
            cache.check_invariants()
            known = [list(request.all_token_ids) for request in self.harness.requests.values()]
            for path in leaf_paths(cache.tree):
                assert any(tokens[: len(path)] == path for tokens in known), (
                    f"the tree holds {path}, which no request's tokens start with")

    DraftMachine.TestCase().runTest()


class TieredMachine(HarnessMachine):
    """``HarnessMachine`` with host and disk tiers (``begin``), every request run to its
    end and the device cache dropped now and then, and disk files damaged (failed
    loads); checks the cache, the planner and its host mirror. Subclasses add ``start``."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvb-async-tiers-")

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def begin(self, config, num_blocks: int, seed: int, window: int | None = None) -> None:
        """A harness on ``config`` (tiers selected) whose host tier holds two tier blocks."""
        groups = 2 if window else 1  # a tier block holds a block of each group
        self.harness = AsyncHarness(copy.deepcopy(config), num_blocks=num_blocks, tiers={
            "host_cache_gb": tier_gb(config, 2 * groups), "disk_cache_dir": self.root},
            seed=seed, window=window)
        # A failed prefetch leaves the mirror wrong by design (the planner's docstring).
        self.harness.scheduler.connector.planner.prefetch_step_blocks = 0

    @rule(damage=st.lists(st.tuples(st.integers(0, 1 << 20), st.booleans()), max_size=2))
    def finish_all_and_drop_the_device_cache(self, damage):
        """Run every request to its end and damage some disk files; prompts seen
        before then load from host or disk."""
        self.harness.run_to_end()
        assert self.harness.scheduler.kv_cache_manager.reset_prefix_cache()
        for pick, rot in damage:
            damage_a_disk_file(self.root, pick, rot)

    @invariant()
    def cache_and_tiers_are_consistent(self):
        scheduler = self.harness.scheduler
        scheduler.kv_cache_manager.cache.check_invariants()
        planner = scheduler.connector.planner
        planner.check_invariants()
        if not self.harness.in_flight:  # else a failure report may be on its way
            assert self.harness.host_mirror_is_the_host_tier(), (
                "a failed load's key stayed in the host mirror")


def test_kvbackend_async_scheduling_with_tiers_stateful(config, spec_config):
    """The machine above with host and disk tiers, failed loads and up to two steps in
    flight; a quarter of the runs schedule synchronously, a quarter decode with drafts."""
    sync_tiered = with_tiers(config)
    sync_tiered.scheduler_config.async_scheduling = False
    configs = {"async": with_tiers(config), "sync": sync_tiered,
               "async-drafts": with_tiers(spec_config)}

    class TieredAsyncMachine(TieredMachine):
        @initialize(mode=st.sampled_from(["async", "async", "async-drafts", "sync"]),
                    seed=st.integers(0, 99))
        def start(self, mode, seed):
            self.begin(configs[mode], NUM_BLOCKS, seed)

    TieredAsyncMachine.TestCase.settings = settings(TieredAsyncMachine.TestCase.settings,
                                                    max_examples=60, stateful_step_count=30)
    TieredAsyncMachine.TestCase().runTest()
