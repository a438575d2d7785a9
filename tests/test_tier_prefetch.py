"""Prefetch on arrival (issue 14 item 2): a waiting request's disk blocks are read into
the host tier, on real disk, host and worker tiers (the stateful planner test drives it
among everything else)."""

from __future__ import annotations

import os

import pytest
import torch

from kvbackend.ops import BlockMover
from kvbackend.store import CacheIdentity, DiskTier, HostTier, compute_block_keys
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source, StepOrders
from kvbackend.vllm.tiers.planner import TierPlanner
from kvbackend.vllm.tiers.worker import TierWorker
from tests.store_helpers import damage_file

BS = 4
ROW = 64  # bytes of one block over all layers
IDENTITY = CacheIdentity(model_fingerprint="sim", kv_dtype="uint8", block_size=BS,
                         kv_layout="sim", tp_rank=0, tp_size=1)
DOC = list(range(3, 3 + 3 * BS + 1))  # three full blocks
OTHER = list(range(60, 60 + 4 * BS + 1))  # four


class Tiers:
    """One worker's real tiers (four host blocks) and the planner that orders them."""

    def __init__(self, root: str) -> None:
        self.cache = torch.zeros(16, ROW, dtype=torch.uint8)
        self.host = HostTier(4 * ROW)
        self.disk = DiskTier(root, 1 << 20, IDENTITY, durable=False, rescan_interval_s=None)
        self.worker = TierWorker(BlockMover([self.cache], 0, ROW, BS, self.host, self.disk))
        self.planner = TierPlanner(BS, IDENTITY.digest(), 4, self.disk.contains,
                                   max_retained=2, clock=lambda: 0.0,
                                   prefetch_step_blocks=3)

    def run(self, orders: StepOrders, computed: dict[int, int] | None = None) -> set[int]:
        """The workers' step: loads, forward pass (``computed``: block id -> its bytes'
        value), saves and prefetches; returns the failed loads, reported to the planner."""
        self.worker.start_step(orders)
        for block_id, value in (computed or {}).items():
            self.cache[block_id] = value
        self.worker.finish_step(orders)
        failed = self.worker.take_load_errors()
        self.planner.step_finished(failed)
        self.planner.check_invariants()
        assert set(self.planner.host.keys()) == set(self.host.keys_lru())
        return failed

    def turn(self, rid: str, tokens: list[int], first_block: int, retain_s: float = 0.0):
        """Compute and finish ``rid`` in blocks from ``first_block`` on (block i holds
        the value i + 1): saved to host and disk."""
        ids = list(range(first_block, first_block + len(tokens) // BS + 1))
        assert self.planner.lookup(rid, tokens, b"", 0) == 0
        self.planner.allocated(rid, ids, 0)
        orders = self.planner.plan_step([ScheduledRequest(rid, 0, len(tokens), ids)])
        self.run(orders, {b: b + 1 for b in ids[:-1]})
        self.planner.request_finished(rid, retain_s)

    def admit(self, rid: str, tokens: list[int], ids: list[int]) -> tuple[int, StepOrders]:
        hit = self.planner.lookup(rid, tokens, b"", 0)
        self.planner.allocated(rid, ids, hit)
        return hit, self.planner.plan_step([ScheduledRequest(rid, hit, len(tokens) - hit, ids)])


@pytest.fixture
def tiers(tmp_path):
    """DOC's three blocks on disk only; OTHER's four in host (its first two retained)
    and on disk."""
    t = Tiers(str(tmp_path))
    t.turn("doc", DOC, first_block=0)
    t.turn("other", OTHER, first_block=4, retain_s=100.0)
    assert t.planner.host.retained() == t.planner.host.keys()[-2:]
    return t


def test_an_arriving_request_is_a_host_hit_the_next_step_within_the_cap(tiers):
    t = tiers
    retained = t.planner.host.retained()
    pinned = compute_block_keys(OTHER[:BS], BS, IDENTITY.digest(), b"")
    assert t.planner.lookup("p", OTHER[: BS + 1], b"", 0) == BS  # pins the first block
    before = t.planner.host.keys()
    assert t.planner.prefetch("a", DOC, b"") == 2, "only two ordinary keys may go"
    assert t.planner.prefetch("b", DOC, b"") == 0
    evicted = [k for k in before if k not in t.planner.host]
    assert len(evicted) == 2 and not set(evicted) & set(pinned + retained), (
        "a prefetch evicted a pinned or retained key")
    assert t.planner.host.retained() == retained
    t.planner.allocated("p", [8, 9], 0)  # p takes nothing after all: unpinned
    orders = t.planner.plan_step([])
    assert len(orders.prefetches) == 2 and set(orders.drops) == set(evicted)
    t.run(orders)
    assert all(t.host.contains(k) for k, _ in orders.prefetches)

    t.cache.zero_()
    hit, orders = t.admit("a", DOC, [0, 1, 2, 3])
    assert hit == 3 * BS
    assert t.planner.hit_sources("a", hit) == {Source.HOST: 2 * BS, Source.DISK: BS}
    assert not t.run(orders)
    assert [int(t.cache[b, 0]) for b in range(3)] == [1, 2, 3]


def test_an_aborted_request_drops_its_prefetches_within_the_cap(tiers):
    t = tiers
    t.planner.prefetch_step_blocks = 1
    before = t.planner.host.keys()
    assert t.planner.prefetch("a", DOC, b"") == 1
    assert t.planner.prefetch("b", DOC[BS:], b"") == 0, "over the cap"
    t.planner.request_finished("a")
    t.planner.check_invariants()
    assert not set(t.planner.host.keys()) - set(before)
    orders = t.planner.plan_step([])
    assert not orders.prefetches
    t.run(orders)  # the evictions it made stand: the mirror still equals the host tier


def test_an_admission_in_the_same_step_loads_and_promotes_instead(tiers):
    t = tiers
    assert t.planner.prefetch("a", DOC, b"") == 2
    hit, orders = t.admit("a", DOC, [0, 1, 2, 3])
    assert hit == 3 * BS, "arriving keys are disk hits"
    assert not orders.prefetches, "read twice"
    assert orders.loads[1].promote, "the load puts the prefetched key in host instead"
    assert all(o.promote == (o.key in t.planner.host) for o in orders.loads)
    t.cache.zero_()
    assert not t.run(orders)
    assert [int(t.cache[b, 0]) for b in range(3)] == [1, 2, 3]


def test_a_damaged_disk_file_is_never_a_wrong_hit(tiers):
    """The prefetch of a rotten file fails; the mirror still lists it, so the next
    admission's host hit misses, the disk read fails too, and vLLM recomputes: the block
    is left untouched and its key leaves the mirror."""
    t = tiers
    assert t.planner.prefetch("a", DOC, b"") == 2
    orders = t.planner.plan_step([])
    rotten, _ = orders.prefetches[1]
    path = next(os.path.join(d, f) for d, _, files in os.walk(t.disk.base) for f in files
                if f == rotten + ".kvb")
    damage_file(path, rot=True)
    t.worker.start_step(orders)
    t.worker.finish_step(orders)
    assert not t.host.contains(rotten) and rotten in t.planner.host  # the mirror is wrong

    t.cache.fill_(7)
    hit, orders = t.admit("a", DOC, [0, 1, 2, 3])
    assert t.planner.hit_sources("a", hit)[Source.HOST] == 2 * BS
    t.worker.start_step(orders)
    t.worker.finish_step(orders)
    failed = t.worker.take_load_errors()
    assert failed == {1}
    assert int(t.cache[0, 0]) == 1 and bool((t.cache[1] == 7).all()), "wrong KV served"
    t.planner.step_finished(failed)
    assert rotten not in t.planner.host
    assert (orders := t.planner.plan_step([])).drops == (rotten,)
    t.planner.check_invariants()


def test_a_prefetch_evicts_none_of_its_own_blocks(tmp_path):
    """DOC's first block left host for disk, its other two stayed: prefetching the first
    must evict another request's block, not DOC's own, or the hit would still read disk."""
    t = Tiers(str(tmp_path))
    t.turn("doc", DOC, first_block=0)
    t.turn("one", OTHER[: BS + 1], first_block=4)
    t.turn("two", list(range(200, 200 + BS + 1)), first_block=6)  # evicts DOC's first block
    assert t.planner.prefetch("a", DOC, b"") == 1
    t.run(t.planner.plan_step([]))
    t.cache.zero_()
    hit, orders = t.admit("a", DOC, [0, 1, 2, 3])
    assert t.planner.hit_sources("a", hit) == {Source.HOST: 3 * BS}
    assert not t.run(orders)
    assert [int(t.cache[b, 0]) for b in range(3)] == [1, 2, 3]
