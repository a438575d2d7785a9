"""The tier planner's answers to what vLLM's normal call order never produces (the
stateful test in test_tier_planner_stateful.py covers that order), and its host mirror."""

from __future__ import annotations

import pytest
import torch

from kvbackend.ops import BlockMover
from kvbackend.store import CacheIdentity, DiskTier, HostTier
from kvbackend.vllm.tiers.host_mirror import HostMirror
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source
from kvbackend.vllm.tiers.planner import TierPlanner
from kvbackend.vllm.tiers.worker import TierWorker

BS = 4
ROW = 64  # bytes of one block over all layers
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
    assert orders.failed == tuple(("r", b) for b in (7, 8, 9, 10, 11))
    assert not orders.loads and not orders.saves
    planner.step_finished({7, 8, 9, 10, 11})  # vLLM recomputes from block 0
    orders = planner.plan_step([ScheduledRequest("r", 0, 4 * BS + 1, [7, 8, 9, 10, 11])])
    assert [o.block_id for o in orders.saves] == [7, 8, 9, 10]
    planner.check_invariants()


def test_a_mirror_full_of_pinned_keys_refuses_inserts():
    mirror = HostMirror(2)
    for key in ("a", "b"):
        mirror.insert(key)
    mirror.orders_sent()  # the workers hold them: they may be pinned as host hits
    for key in ("a", "b"):
        mirror.pin(key)
    assert mirror.insert("c") == (False, ())
    mirror.unpin("a")
    assert mirror.insert("c") == (True, ("a",))
    assert mirror.keys() == ["b", "c"]
    mirror.check_invariants()
    with pytest.raises(RuntimeError, match="not pinned"):
        mirror.unpin("a")


def test_a_block_promoted_in_this_step_is_a_disk_hit_for_the_next_admission(tmp_path):
    """Two admissions of one step share a block only the disk holds. The first one's load
    promotes it into the host mirror, but no worker's host tier holds it before the loads
    run: the second admission's hit is a disk hit too. It was advertised (and counted) as
    a host hit, so when the first one's disk read failed, a "host" load failed with it
    (issue 9; found by the stateful test)."""
    identity = CacheIdentity(model_fingerprint="sim", kv_dtype="uint8", block_size=BS,
                             kv_layout="sim", tp_rank=0, tp_size=1)
    cache = torch.zeros(8, ROW, dtype=torch.uint8)
    host = HostTier(1 * ROW)  # one block: the mirror's capacity
    disk = DiskTier(str(tmp_path), 1 << 20, identity, durable=False, rescan_interval_s=None)
    worker = TierWorker(BlockMover([cache], 0, ROW, BS, host, disk))
    planner = TierPlanner(BS, identity.digest(), 1, disk.contains)

    def run(orders, computed=()):
        worker.start_step(orders)
        for block_id in computed:
            cache[block_id] = block_id + 1
        worker.finish_step(orders)
        planner.step_finished(worker.take_load_errors())

    doc, other = list(range(3, 3 + BS + 1)), list(range(40, 40 + BS + 1))
    for rid, tokens in (("w", doc), ("x", other)):  # doc's block saved, then evicted by other's
        assert planner.lookup(rid, tokens, b"", 0) == 0
        planner.allocated(rid, [0, 1], 0)
        run(planner.plan_step([ScheduledRequest(rid, 0, BS + 1, [0, 1])]), computed=[0])
        planner.request_finished(rid)
    assert planner.host.keys() == host.keys_lru() and len(disk) == 2

    assert planner.lookup("a", list(doc), b"", 0) == BS
    planner.allocated("a", [2, 3], BS)  # promotes doc's block into the mirror
    assert planner.lookup("b", list(doc), b"", 0) == BS
    planner.allocated("b", [4, 5], BS)
    planner.check_invariants()
    assert planner.hit_sources("b", BS) == {Source.DISK: BS}, "not a host hit: no host holds it"
    orders = planner.plan_step([ScheduledRequest(r, BS, 1, ids)
                                for r, ids in (("a", [2, 3]), ("b", [4, 5]))])
    assert [o.promote for o in orders.loads] == [True, False]
    run(orders)
    assert torch.equal(cache[2], cache[0]) and torch.equal(cache[4], cache[0])
    assert planner.host.keys() == host.keys_lru()
    planner.check_invariants()


def test_a_retained_context_outlasts_ordinary_traffic_in_the_host_tier_until_its_time():
    """``kv_retain_s`` reaches the host tier: an agent's context, retained when its turn
    ends, stays in every worker's host tier while one-shot requests that did not ask for
    retention churn through it, and its resumed turn loads it from there. Once the
    retention's time is up it is the first to leave (issue 14)."""
    now = [0.0]
    cache = torch.zeros(16, ROW, dtype=torch.uint8)
    host = HostTier(4 * ROW)
    worker = TierWorker(BlockMover([cache], 0, ROW, BS, host, None))
    planner = TierPlanner(BS, DIGEST, 4, None, max_retained=2, clock=lambda: now[0])

    def turn(rid, tokens, retain_s=0.0):
        """Admit, compute and finish ``rid``; returns its host hit in tokens."""
        block_ids = list(range(len(tokens) // BS + 1))
        hit = planner.lookup(rid, tokens, b"", 0)
        planner.allocated(rid, block_ids, hit)
        orders = planner.plan_step([ScheduledRequest(rid, hit, len(tokens) - hit, block_ids)])
        worker.start_step(orders)
        for i in range(hit // BS, len(tokens) // BS):
            cache[block_ids[i]] = tokens[i * BS] % 250 + 1  # this block's KV
        worker.finish_step(orders)
        planner.step_finished(worker.take_load_errors())
        planner.request_finished(rid, retain_s)
        planner.check_invariants()
        assert set(planner.host.keys()) == set(host.keys_lru())
        return hit

    agent = list(range(3, 3 + 2 * BS + 1))  # two full blocks
    chats = [list(range(100 + 20 * c, 100 + 20 * c + 2 * BS + 1)) for c in range(4)]
    assert turn("agent-turn0", agent, retain_s=10.0) == 0
    for c in range(3):  # six ordinary blocks through a four-block host tier
        turn(f"chat{c}", chats[c])
    now[0] = 9.0
    resumed = agent + list(range(60, 60 + BS))
    cache.zero_()
    assert turn("agent-turn1", resumed, retain_s=10.0) == 2 * BS, "the context left the host"
    assert torch.equal(cache[0], torch.full((ROW,), 4, dtype=torch.uint8))
    now[0] = 19.0 + 0.5  # the second retention's time is up: first to go
    turn("chat3", chats[3])
    assert turn("agent-turn2", resumed, retain_s=0) == 0, "an expired retention stayed"


def test_with_several_groups_a_failed_load_fails_its_request_and_leaves_the_mirror():
    """Several KV-cache groups: vLLM takes no failed block ids, so every hit loads
    asynchronously and a failed block fails its whole request (``failed_recving``).
    The host keys that request loaded leave the mirror and every worker's host tier:
    vLLM retries the request from scratch, and it must not hit the missing key again."""
    cache = torch.zeros(8, ROW, dtype=torch.uint8)
    host = HostTier(4 * ROW)
    worker = TierWorker(BlockMover([cache], 0, ROW, BS, host, None), fail_requests=True)
    planner = TierPlanner(BS, DIGEST, 4, None, all_loads_async=True)
    tokens = list(range(3, 3 + 2 * BS + 1))
    assert planner.lookup("w", tokens, b"", 0) == 0
    planner.allocated("w", [0, 1, 2], 0)
    orders = planner.plan_step([ScheduledRequest("w", 0, len(tokens), [0, 1, 2])])
    worker.start_step(orders)
    worker.finish_step(orders)
    planner.step_finished(worker.take_load_errors())
    planner.request_finished("w")
    lost, kept = planner.host.keys()
    host.remove(lost)  # this worker lost a block the mirror lists

    assert planner.lookup("r", tokens, b"", 0) == 2 * BS and planner.loads_async("r")
    planner.allocated("r", [3, 4, 5], 2 * BS)
    orders = planner.plan_step([])
    assert orders.async_loads == ("r",) and len(orders.loads) == 2
    worker.start_step(orders)
    worker.finish_step(orders)
    finished = worker.take_finished_loads()
    assert finished == {"r"} and worker.take_load_errors() == set()
    failed = worker.take_failed_requests(finished)
    assert failed == {"r"} and worker.take_failed_requests(finished) == set()
    planner.step_finished((), finished, failed)
    planner.check_invariants()
    assert set(planner.plan_step([]).drops) == {lost, kept} and not planner.host.keys()
    assert planner.lookup("r", tokens, b"", 0) == 0  # the retry recomputes
    planner.check_invariants()


def test_a_block_a_sliding_window_group_no_longer_holds_is_never_saved():
    """With several KV-cache groups each order names the block's physical block in every
    group; a block whose sliding-window group lists vLLM's null block (0: its window page
    was freed) is not whole on the device, so it gets no save order and no host slot
    (the mirror would list a key whose payload lacks a group). A later load of such a
    block names the 0 too: the worker fills the other groups."""
    planner = TierPlanner(BS, DIGEST, host_capacity=8, disk_contains=None)
    tokens = list(range(3, 3 + 3 * BS + 1))
    assert planner.lookup("a", tokens, b"", 0) == 0
    planner.allocated("a", [5, 6, 7, 8], 0, [(5, 0), (6, 0), (7, 17), (8, 18)])
    orders = planner.plan_step([ScheduledRequest("a", 0, len(tokens), [5, 6, 7, 8],
                                                 [(5, 0), (6, 0), (7, 17), (8, 18)])])
    assert [(o.block_id, o.blocks) for o in orders.saves] == [(7, (7, 17))]
    assert len(planner.host.keys()) == 1
    planner.check_invariants()


def test_with_an_eagle_drafter_a_tier_hit_leaves_its_last_block_to_recompute():
    """An EAGLE / MTP drafter's KV at a block's last token read its writer's next token,
    which no block key vouches for: a tier hit ends one block earlier (vLLM drops a hit's
    last block likewise), so that block's drafter KV is recomputed with the request's own
    next token."""
    doc = list(range(3, 3 + 3 * BS + 1))
    for draft_lookahead, hit_blocks in ((0, 3), (1, 2)):
        cache = torch.zeros(8, ROW, dtype=torch.uint8)
        worker = TierWorker(BlockMover([cache], 0, ROW, BS, HostTier(8 * ROW), None))
        planner = TierPlanner(BS, DIGEST, 8, None, draft_lookahead=draft_lookahead)
        assert planner.lookup("w", doc, b"", 0) == 0
        planner.allocated("w", [0, 1, 2, 3], 0)
        orders = planner.plan_step([ScheduledRequest("w", 0, len(doc), [0, 1, 2, 3])])
        worker.start_step(orders)
        worker.finish_step(orders)
        planner.step_finished(worker.take_load_errors())
        planner.request_finished("w")
        assert planner.lookup("r", doc + [99] * BS, b"", 0) == hit_blocks * BS
        planner.check_invariants()
