"""The tier planner's remote tier: lookups continue below host and disk, a per-step load budget,
write-through saves, off after a reset. (The remote tier itself is tested on a real server in
test_store_remote_tier.py and inside vLLM in tests/vllm/test_remote_tier.py.)"""

from __future__ import annotations

from kvbackend.store import compute_block_keys
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source, TierFact
from kvbackend.vllm.tiers.planner import TierPlanner

BS = 4
DIGEST = "ab" * 32
TOKENS = list(range(100, 141))  # 10 full blocks and one token
KEYS = compute_block_keys(TOKENS, BS, DIGEST, b"")


class Remote:
    """What the server holds, and every batch of keys the planner asked about."""

    def __init__(self, held) -> None:
        self.held, self.asked = set(held), []

    def __call__(self, keys: list[str]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.held for k in keys]


def planner(remote: Remote, on_disk=(), step_blocks: int = 100, host: int = 16) -> TierPlanner:
    disk = set(on_disk)
    return TierPlanner(BS, DIGEST, host, disk.__contains__ if disk else None, remote,
                       step_blocks)


def admit(p: TierPlanner, request_id: str, tokens=TOKENS, block_ids=range(1, 12)) -> int:
    hit = p.lookup(request_id, tokens, b"", 0)
    p.allocated(request_id, list(block_ids), hit)
    p.check_invariants()
    return hit


def test_a_lookup_continues_from_disk_into_the_remote_tier():
    remote = Remote(KEYS[2:8])
    p = planner(remote, on_disk=KEYS[:2])
    assert admit(p, "r") == 8 * BS
    assert remote.asked == [KEYS[2:10]]  # one batch: everything after the disk run
    assert p.hit_sources("r", 8 * BS) == {Source.DISK: 2 * BS, Source.REMOTE: 6 * BS}
    orders = p.plan_step([])
    assert [o.key for o in orders.loads] == KEYS[:8]
    p.check_invariants()


def test_remote_loads_stay_within_the_step_budget():
    remote = Remote(KEYS)
    p = planner(remote, step_blocks=5, host=0)  # no host tier to promote into
    assert admit(p, "a") == 5 * BS
    assert admit(p, "b", block_ids=range(20, 31)) == 0  # the budget is spent in this step
    assert len(p.plan_step([]).loads) == 5
    assert admit(p, "c", block_ids=range(40, 51)) == 5 * BS  # a new step, a new budget


def test_computed_and_loaded_blocks_are_written_through():
    remote = Remote(KEYS[:3])
    p = planner(remote)
    assert admit(p, "r") == 3 * BS
    p.plan_step([])  # the loads run; saves wait until they are known good
    p.step_finished(())
    orders = p.plan_step([ScheduledRequest("r", 3 * BS, len(TOKENS) - 3 * BS, range(1, 12))])
    assert [o.key for o in orders.saves if o.to_remote] == KEYS  # the writer skips held keys
    p.check_invariants()


def test_after_a_reset_the_remote_tier_is_off():
    remote = Remote(KEYS)
    p = planner(remote)
    p.reset()
    assert admit(p, "r") == 0 and remote.asked == []
    orders = p.plan_step([ScheduledRequest("r", 0, len(TOKENS), range(1, 12))])
    assert orders.disk_off and not any(o.to_remote for o in orders.saves)
    p.check_invariants()


def test_a_remote_hit_loads_asynchronously_and_is_not_promoted():
    remote = Remote(KEYS[2:8])
    p = planner(remote, on_disk=KEYS[:2] + KEYS[20:])
    assert admit(p, "r") == 8 * BS and p.loads_async("r")
    assert admit(p, "d", tokens=TOKENS[:2 * BS + 1], block_ids=range(20, 23)) == 2 * BS
    assert not p.loads_async("d")  # host and disk hits stay synchronous
    orders = p.plan_step([])
    assert orders.async_loads == ("r",)  # vLLM parks it until the workers report it
    promoted = {o.key for o in orders.loads if o.promote}
    assert promoted == set(KEYS[:2])  # a remote block arrives steps later: not in the mirror
    assert not any(p.host.holds(k) for k in KEYS[2:8])
    p.check_invariants()
    assert p.plan_step([]).async_loads == ()  # listed once


def test_a_remote_hit_adopted_wrongly_is_still_reported_as_an_async_load():
    p = planner(Remote(KEYS[:3]))
    assert p.lookup("r", TOKENS, b"", 0) == 3 * BS and p.loads_async("r")
    p.allocated("r", list(range(1, 12)), 5 * BS)  # more than offered: a bug, failed loads
    orders = p.plan_step([])
    assert orders.async_loads == ("r",) and set(orders.failed) == {("r", b) for b in range(1, 12)}
    p.check_invariants()


def test_an_unadopted_remote_hit_is_no_async_load():
    p = planner(Remote(KEYS))
    assert p.lookup("r", TOKENS, b"", 0) > 0
    p.allocated("r", list(range(1, 12)), 0)  # vLLM took none of it (e.g. a local hit won)
    assert p.plan_step([]).async_loads == ()
    p.check_invariants()


def test_what_lookups_and_loads_learn_of_disk_and_remote_keys_is_told_for_kv_events():
    """The keys a lookup found missing (the first after each tier's run), the keys a
    load reads from disk or the remote tier (with the block they fill), and the keys
    of failed loads (gone from both, as far as the scheduler knows), in that order."""
    remote = Remote(KEYS[2:5])
    p = planner(remote, on_disk=KEYS[:2])
    assert admit(p, "r") == 5 * BS
    assert p.take_tier_facts() == [
        TierFact(Source.DISK, KEYS[2], None), TierFact(Source.REMOTE, KEYS[5], None),
        TierFact(Source.DISK, KEYS[0], 1), TierFact(Source.DISK, KEYS[1], 2),
        *[TierFact(Source.REMOTE, KEYS[i], i + 1) for i in range(2, 5)]]
    assert p.take_tier_facts() == []
    p.plan_step([])
    p.step_finished({2})
    assert p.take_tier_facts() == [TierFact(Source.DISK, KEYS[1], None),
                                   TierFact(Source.REMOTE, KEYS[1], None)]
