"""kvbackend under async scheduling with a KV connector that loads outside the step order.

vLLM defers block frees for every connector that loads (``Scheduler.defer_block_free``):
such a connector may fill a block handed out in step N+1 while step N still uses it.
kvbackend frees at once and keeps such loads off the blocks a step in flight uses
(``StepFence``). ``StoreConnector`` (``store_connector.py``) loads stored prompts
synchronously or not, and some loads fail; ``AsyncHarness`` checks that it never loads
into a block a step in flight still uses, every read of every step, and that the tree
never lists a load not known good.
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from vllm.config import KVTransferConfig
from vllm.v1.request import RequestStatus

from kvbackend.vllm import engine_kwargs, tier_transfer_config
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.connectors import compose
from kvbackend.vllm.scheduler import unsupported_features
from tests.vllm.async_harness import AsyncHarness, async_config, tier_gb
from tests.vllm.store_connector import store_transfer_config
from tests.vllm.test_async_scheduling import PREFIXES, HarnessMachine

BLOCK_SIZE = 4
NUM_BLOCKS = 10


@pytest.fixture(scope="module")
def config(tiny_model):
    return async_config(tiny_model, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                        max_num_seqs=3)


def with_transfer(config, transfer: dict, async_scheduling: bool = True):
    """``config`` with the connector(s) ``transfer`` selects (``KVTransferConfig`` fields)."""
    config = copy.deepcopy(config)
    config.kv_transfer_config = KVTransferConfig(**transfer)
    config.scheduler_config.async_scheduling = async_scheduling
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # as vLLM sets it
    return config


def with_store(config, prompts, async_scheduling: bool = True, **store):
    return with_transfer(config, store_transfer_config(prompts, **store), async_scheduling)


def failing_store(config):
    """``config`` with the store under async scheduling: PREFIXES stored, every third load
    failing, half the requests loading synchronously, a failed load failing its request."""
    return with_store(config, PREFIXES, fail_every=3, sync_ids="odd", policy="fail")


def run_all(harness, arrivals, first: int = 0) -> None:
    """Add ``(prompt, max_tokens)`` requests named r{first}, r{first + 1}, ..., then run
    every request to its end."""
    for i, (prompt, max_tokens) in enumerate(arrivals, start=first):
        harness.add(f"r{i}", prompt, max_tokens=max_tokens)
    harness.run_to_end()


def test_only_connectors_that_load_out_of_step_order_are_fenced(config):
    """A loading connector under async scheduling, alone or after the tiers; not the tiers
    (their loads run in step order), not without async scheduling, not a saving-only one.
    vLLM's own deferral stays off: it would free into vLLM's unused block pool."""
    store = store_transfer_config(PREFIXES)
    tiers = engine_kwargs(host_cache_gb=1)["kv_transfer_config"]
    cases = [(store, True, True), (compose(tiers, store), True, True), (store, False, False),
             (tiers, True, False), ({**store, "kv_role": "kv_producer"}, True, False)]
    for transfer, async_scheduling, fenced in cases:
        chosen = with_transfer(config, transfer, async_scheduling)
        assert unsupported_features(chosen) == []
        scheduler = AsyncHarness(chosen, num_blocks=NUM_BLOCKS).scheduler
        assert scheduler.kv_cache_manager.steps.track is fenced, transfer
        assert scheduler.defer_block_free is False


def test_a_load_waits_for_the_step_in_flight_that_uses_its_blocks(config):
    """local-r's first chunk (4 blocks) runs in step 1; it is aborted while that step is
    in flight, and its blocks are free at once. l loads 6 blocks from the store and needs
    7 in all, more than the 5 never used: given local-r's blocks in step 2, its load would
    fill one while step 1 still writes it. It is admitted in step 3, once step 1 ran."""
    prompt = list(range(100, 128))
    harness = AsyncHarness(with_store(config, [prompt]), num_blocks=NUM_BLOCKS)
    manager = harness.scheduler.kv_cache_manager
    harness.add("local-r", list(range(200, 232)), max_tokens=2)
    harness.schedule()  # step 1: local-r's first 16 tokens
    harness.abort("local-r")
    assert manager.cache.num_allocatable_blocks == NUM_BLOCKS - 1
    harness.add("l", prompt, max_tokens=2)
    assert not harness.schedule().num_scheduled_tokens  # step 2: l waits
    harness.deliver()  # step 1's output
    out = harness.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("l", 24)]
    harness.run_to_end()
    manager.steps.check_invariants()


def test_a_request_needing_almost_every_block_is_not_starved(config):
    """r1 needs 8 of the 9 blocks; r2's load fails. Holding every freed block back until
    the step in flight ran (as vLLM defers its frees) preempted r1 whenever it resumed
    with a partial hit: its copy's source came back a step too late for r1's next block
    (unfinished after 200 steps). Only loads wait now; computing requests take the blocks."""
    harness = AsyncHarness(failing_store(config), num_blocks=NUM_BLOCKS)
    run_all(harness, [(PREFIXES[0], 1)])
    assert harness.scheduler.kv_cache_manager.reset_prefix_cache()
    run_all(harness, [(PREFIXES[0] + [0] * 9, 11), (PREFIXES[0], 1), (PREFIXES[1], 1)], first=1)
    assert harness.requests["r1"].num_output_tokens == 11


@pytest.mark.parametrize("fails", [False, True])
def test_a_synchronous_load_is_published_only_once_its_step_ran(config, fails):
    """l loads two blocks synchronously in step 1 and decodes in step 2, scheduled before
    step 1's output. local-s, admitted in step 2 with the same prompt, must not hit the
    loaded blocks: the load may have failed (``fails``: then l fails, as vLLM's
    ``kv_load_failure_policy="fail"`` says, and the tree never lists its load). Once the
    load is known good, local-t hits it."""
    prompt = list(range(100, 109))
    harness = AsyncHarness(with_store(config, [prompt], fail_every=int(fails), policy="fail"),
                           num_blocks=NUM_BLOCKS)
    manager = harness.scheduler.kv_cache_manager
    harness.add("l", prompt, max_tokens=3)
    out = harness.schedule()  # step 1: l loads 8 tokens, computes its last
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("l", 8)]
    harness.add("local-s", prompt + [1], max_tokens=1)
    hits = manager.hit_tokens
    out = harness.schedule()  # step 2: l decodes; local-s is admitted
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ("local-s", 0)]
    assert manager.hit_tokens == hits
    harness.deliver()  # step 1's output: the load failed or not
    harness.run_to_end()
    assert (harness.requests["l"].status == RequestStatus.FINISHED_ERROR) is fails
    harness.add("local-t", prompt + [2], max_tokens=1)
    hits = manager.hit_tokens
    harness.run_to_end()
    assert manager.hit_tokens - hits == len(prompt)  # from l's load, or local-s's own KV


def test_kvbackend_async_scheduling_with_a_loading_connector_stateful(config):
    """``HarnessMachine`` with the store: every third load fails. Under async scheduling
    half the requests load synchronously and a failed load fails its request (vLLM 0.32
    mishandles a recomputed synchronous load there: the request's step scheduled before
    the failure is known appends a token to its cut-back tokens); with synchronous
    scheduling a failed load is recomputed. A quarter of the runs compose the store
    after kvbackend's host and disk tiers (``MultiConnector``), loading asynchronously."""

    def configured(mode: str, seed: int, root: str):
        if mode == "sync":
            return with_store(config, PREFIXES, async_scheduling=False, fail_every=3,
                              sync_ids="odd", seed=seed)
        if mode == "async":
            return with_store(config, PREFIXES, fail_every=3, sync_ids="odd", policy="fail",
                              seed=seed)
        tiers = tier_transfer_config(KVBackendConfig.from_dict(
            {"host_cache_gb": tier_gb(config, 2), "disk_cache_dir": root}))
        store = store_transfer_config(PREFIXES, fail_every=3, sync_ids="none", seed=seed)
        return with_transfer(config, compose(tiers, store))

    class StoreMachine(HarnessMachine):
        def __init__(self) -> None:
            super().__init__()
            self.root = tempfile.mkdtemp(prefix="kvb-store-tiers-")

        def teardown(self) -> None:
            shutil.rmtree(self.root, ignore_errors=True)

        @initialize(mode=st.sampled_from(["async", "async", "sync", "async-tiers"]),
                    seed=st.integers(0, 99))
        def start(self, mode, seed):
            self.harness = AsyncHarness(configured(mode, seed, self.root),
                                        num_blocks=NUM_BLOCKS)

        @rule(steps=st.integers(1, 8))
        def run_pipelined(self, steps):
            """Keep the batch queue full for ``steps`` steps, as the engine core does."""
            harness = self.harness
            for _ in range(steps):
                if len(harness.in_flight) == harness.max_in_flight:
                    harness.deliver()
                if harness.scheduler.has_unfinished_requests():
                    harness.schedule()

        @rule()
        def drop_the_device_cache(self):
            """Prompts seen before then load from the store (or the tiers)."""
            self.harness.run_to_end()
            assert self.harness.scheduler.kv_cache_manager.reset_prefix_cache()

        @invariant()
        def cache_and_fence_are_consistent(self):
            scheduler = self.harness.scheduler
            scheduler.kv_cache_manager.cache.check_invariants()
            scheduler.kv_cache_manager.steps.check_invariants()
            for child in getattr(scheduler.connector, "sub_connectors", []):
                if getattr(child, "planner", None) is not None:
                    child.planner.check_invariants()

    StoreMachine.TestCase.settings = settings(StoreMachine.TestCase.settings,
                                              max_examples=300, stateful_step_count=30)
    StoreMachine.TestCase().runTest()


def test_an_in_flight_prefill_reserves_only_the_blocks_it_lacks(config):
    """vLLM reserves the blocks in-flight prefills still need before it admits an
    asynchronous load; it read them from its own coordinator, which kvbackend leaves
    empty, and so reserved local-a's whole sequence (8 blocks), not the 4 it lacks."""
    harness = AsyncHarness(with_store(config, PREFIXES), num_blocks=NUM_BLOCKS)
    harness.add("local-a", list(range(100, 130)), max_tokens=1)
    harness.schedule()  # its first 16 tokens: 4 blocks
    request = harness.scheduler.requests["local-a"]
    assert harness.scheduler._request_remaining_blocks(request) == 8 - 4


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_whose_asynchronous_load_failed_outright_is_admitted_again(
        config, async_scheduling):
    """r2 loads one block asynchronously, which fails (the next load does not): vLLM frees
    r2 and admits it again as a new request, but keeps it among its in-flight prefills,
    whose reserve then counted against its own admission: 5 of the 9 blocks for its
    whole sequence, plus 5 to admit it (never admitted). It holds no blocks then, so it
    reserves none."""
    harness = AsyncHarness(with_store(config, [[1, 2, 3, 4]], async_scheduling,
                                      fail_every=2, sync_ids="none"), num_blocks=NUM_BLOCKS)
    harness.add("r2", [1, 2, 3, 4] + list(range(10, 26)), max_tokens=1)
    harness.run_to_end()
    assert harness.requests["r2"].num_output_tokens == 1


def test_a_request_is_not_starved_by_copies_its_own_cached_path_holds(config):
    """r5 is preempted at 28 tokens; the tree then lists its 7 blocks and two more that
    nodes on its path hold although their continuations copied them (their swap was
    refused while they had other sharers): all 9 blocks. Locking r5's hit kept them
    all, and r5 waited forever for one block. A sequence short of blocks now makes the
    nodes on its own path take their continuations' copies."""
    harness = AsyncHarness(failing_store(config), num_blocks=NUM_BLOCKS)
    run_all(harness, [(PREFIXES[0], 1)])
    assert harness.scheduler.kv_cache_manager.reset_prefix_cache()
    run_all(harness, [(PREFIXES[0], 1)] * 3 + [(PREFIXES[1], 1), (PREFIXES[0] + [0] * 9, 11),
                                              (PREFIXES[0], 1)], first=1)
    assert harness.requests["r5"].num_output_tokens == 11


def test_a_running_request_is_not_preempted_for_copies_its_own_cached_path_holds(config):
    """r2 (30 tokens, 8 of the 9 blocks) resumes from its preemption with a partial hit;
    its next block then had to come from nodes on its locked path that still list blocks
    their continuations copied. The manager's room check dropped only the candidates'
    copies, so it preempted r2 again at every resume (unfinished after 200 steps)."""
    harness = AsyncHarness(failing_store(config), num_blocks=NUM_BLOCKS)
    run_all(harness, [(PREFIXES[0], 1), (PREFIXES[0], 1), (PREFIXES[0] + [0] * 8, 12),
                      (PREFIXES[0], 7)])
    assert harness.requests["r2"].num_output_tokens == 12


def test_a_failed_load_reported_after_its_request_was_freed_blames_no_one_else(config):
    """l's synchronous load fails in step 1, and l is aborted while step 1 runs: its
    blocks go back at once, and local-c computes into them in step 2 (only loads wait
    for step 1). Step 1's report then named a block local-c holds: vLLM failed local-c
    for a load it never made (and evict_blocks found the block published)."""
    chosen = with_store(config, [list(range(100, 108))], fail_every=1, policy="fail")
    chosen.scheduler_config.max_num_batched_tokens = 64
    chosen.scheduler_config.max_num_scheduled_tokens = 64
    harness = AsyncHarness(chosen, num_blocks=NUM_BLOCKS)
    harness.add("local-b", list(range(200, 212)), max_tokens=4)  # 3 blocks
    harness.add("l", list(range(100, 109)), max_tokens=2)  # loads 2 blocks, 3 in all
    harness.schedule()
    harness.abort("l")
    harness.add("local-c", list(range(300, 320)), max_tokens=2)  # 5 blocks: l's 3 too
    out = harness.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["local-c"]
    harness.run_to_end()
    assert harness.requests["local-c"].status == RequestStatus.FINISHED_LENGTH_CAPPED
