"""The tier planner with a Mamba / linear-attention hybrid's state group ("State
checkpoints" in ``kvbackend/vllm/tiers/planner.py``): which blocks are saved as
checkpoints, and that a hit ends on one, loading its state pages and no other's.

Physical tuples here are (state group, attention group)."""

from __future__ import annotations

from kvbackend.store import checkpoint_key, compute_block_keys
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source
from kvbackend.vllm.tiers.planner import TierPlanner
from tests.test_tier_planner_remote import Remote

BS = 4
DIGEST = "cd" * 32
PROMPT = list(range(5, 5 + 3 * BS + 1))  # three whole blocks and one token


def _planner(disk_contains=None) -> TierPlanner:
    return TierPlanner(BS, DIGEST, host_capacity=16, disk_contains=disk_contains,
                       state_groups=(0,))


def _table(first: int, n: int) -> tuple[list[int], list[tuple[int, int]]]:
    ids = list(range(first, first + n))
    return ids, [(b, 100 + b) for b in ids]


def _prefill(planner: TierPlanner, request_id: str, tokens: list[int], chunk_ends: list[int],
             first_block: int = 1) -> list:
    """Admit ``request_id`` with no hit and run its prefill in steps ending on
    ``chunk_ends``; the save orders of every step."""
    assert planner.lookup(request_id, tokens, b"", 0) == 0
    ids, physical = _table(first_block, -(-len(tokens) // BS))
    planner.allocated(request_id, ids, 0, physical)
    saves, start = [], 0
    for end in chunk_ends:
        orders = planner.plan_step([ScheduledRequest(request_id, start, end - start, ids,
                                                     physical)])
        saves += orders.saves
        planner.step_finished(())
        start = end
    planner.check_invariants()
    return saves


def test_only_a_block_a_step_ended_on_is_saved_as_a_checkpoint():
    """Chunks ending on 8 and 13: blocks 0-2 are saved with every page; block 1 (the step
    ending on 8) is saved a second time, under its checkpoint key, and no other is."""
    planner = _planner()
    saves = _prefill(planner, "a", PROMPT, [2 * BS, 3 * BS + 1])
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    assert [(o.key, o.block_id, o.physical, o.checkpoint) for o in saves] == [
        (keys[0], 1, (1, 101), False), (keys[1], 2, (2, 102), False),
        (checkpoint_key(keys[1]), 2, (2, 102), True), (keys[2], 3, (3, 103), False)]


def test_a_block_without_state_pages_still_gets_its_ordinary_copy():
    """kvbackend's manager lists the null block (0) in the state group wherever a block
    has no state page (``PagedBlockGroups``): here every block but 1 (a step ended on
    it) and 3 (where the last step ends). Their ordinary copies hold attention pages
    only, so all three whole blocks are saved; the checkpoint copy of block 1 takes its
    state page."""
    planner = _planner()
    assert planner.lookup("a", PROMPT, b"", 0) == 0
    ids = [1, 2, 3, 4]
    physical = [(b if i in (1, 3) else 0, 100 + b) for i, b in enumerate(ids)]
    planner.allocated("a", ids, 0, physical)
    saves = []
    for start, end in ((0, 2 * BS), (2 * BS, 3 * BS + 1)):
        saves += planner.plan_step([ScheduledRequest("a", start, end - start, ids,
                                                     physical)]).saves
        planner.step_finished(())
    planner.check_invariants()
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    assert [(o.key, o.block_id, o.physical, o.checkpoint) for o in saves] == [
        (keys[0], 1, (0, 101), False), (keys[1], 2, (2, 102), False),
        (checkpoint_key(keys[1]), 2, (2, 102), True), (keys[2], 3, (0, 103), False)]


def test_a_hit_ends_on_its_last_checkpoint_and_loads_only_that_blocks_state():
    """A second request shares all three whole blocks, but only block 1 holds a state:
    the hit is two blocks; block 0 loads its attention page only (its state page stays
    0 in the order), block 1 loads its checkpoint copy, state page included."""
    planner = _planner()
    _prefill(planner, "a", PROMPT, [2 * BS, 3 * BS + 1])
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    other = PROMPT + [7, 7, 7]
    assert planner.lookup("b", other, b"", 0) == 2 * BS
    ids, physical = _table(20, 4)
    planner.allocated("b", ids, 2 * BS, physical)
    assert planner.hit_sources("b", 2 * BS) == {Source.HOST: 2 * BS}
    orders = planner.plan_step([])
    assert [(o.block_id, o.key, o.physical, o.checkpoint) for o in orders.loads] == [
        (20, keys[0], (0, 120), False), (21, checkpoint_key(keys[1]), (21, 121), True)]
    planner.check_invariants()


def test_no_checkpoint_in_the_hit_means_no_hit():
    """One chunk ending on 13 leaves no checkpoint on a block boundary: nothing to
    resume from, whatever the tiers hold."""
    planner = _planner()
    _prefill(planner, "a", PROMPT, [3 * BS + 1])
    assert planner.lookup("b", PROMPT + [9], b"", 0) == 0
    planner.check_invariants()


def test_a_checkpoint_on_disk_only_is_found_there():
    """The block keys are in host memory, the checkpoint copy on disk only (another
    process wrote it): the hit's last block loads from disk."""
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    planner = _planner(disk_contains={checkpoint_key(keys[2])}.__contains__)
    _prefill(planner, "a", PROMPT, [3 * BS + 1])
    assert planner.lookup("b", PROMPT + [9], b"", 0) == 3 * BS
    ids, physical = _table(30, 4)
    planner.allocated("b", ids, 3 * BS, physical)
    assert planner.hit_sources("b", 3 * BS) == {Source.HOST: 2 * BS, Source.DISK: BS}
    last = planner.plan_step([]).loads[-1]
    assert (last.key, last.physical, last.checkpoint) == (checkpoint_key(keys[2]), (32, 132), True)
    planner.check_invariants()


def test_adopting_less_than_the_hit_fails_its_blocks():
    """A hit cut short by vLLM would not end on the checkpoint its lookup found: every
    block is reported as a failed load (recomputed), none is loaded."""
    planner = _planner()
    _prefill(planner, "a", PROMPT, [2 * BS, 3 * BS + 1])
    assert planner.lookup("b", PROMPT + [1], b"", 0) == 2 * BS
    ids, physical = _table(40, 4)
    planner.allocated("b", ids, BS, physical)
    orders = planner.plan_step([])
    assert not orders.loads and orders.failed == tuple(("b", b) for b in ids)
    planner.check_invariants()


def test_a_step_end_whose_token_is_not_known_yet_still_marks_its_block():
    """Async scheduling: a decode step ends on a boundary before its token is sampled,
    so the block is considered for saving a step later; it is saved as a checkpoint
    then (no later step writes its state page)."""
    planner = _planner()
    tokens = PROMPT[:2 * BS - 1]
    assert planner.lookup("a", tokens, b"", 0) == 0
    ids, physical = _table(1, 2)
    planner.allocated("a", ids, 0, physical)
    orders = planner.plan_step([ScheduledRequest("a", 0, 2 * BS - 1, ids, physical)])
    assert [o.block_id for o in orders.saves] == [1]
    orders = planner.plan_step([ScheduledRequest("a", 2 * BS - 1, 1, ids, physical)])
    assert not orders.saves  # the token at 7 is not sampled yet
    tokens.append(42)
    orders = planner.plan_step([ScheduledRequest("a", 2 * BS, 1, ids, physical)])
    key = compute_block_keys(tokens, BS, DIGEST)[1]
    assert [(o.key, o.checkpoint) for o in orders.saves] == [(key, False),
                                                             (checkpoint_key(key), True)]
    planner.check_invariants()


def test_a_retained_context_keeps_its_checkpoint_copies():
    """``kv_retain_s``: ordinary traffic that fills the host tier evicts neither the
    retained blocks nor the checkpoint copy a hit on them must end on (an ordinary
    checkpoint key went first, and the retained context was no hit at all)."""
    now = [0.0]
    planner = TierPlanner(BS, DIGEST, host_capacity=8, disk_contains=None, max_retained=4,
                          clock=lambda: now[0], state_groups=(0,))
    _prefill(planner, "a", PROMPT, [2 * BS, 3 * BS + 1])  # k0, k1, ck1, k2
    planner.request_finished("a", retain_s=10.0)
    other = [900 + t for t in range(6 * BS + 1)]
    _prefill(planner, "c", other, [len(other)], first_block=50)  # six ordinary keys
    planner.request_finished("c")
    now[0] = 5.0
    assert planner.lookup("b", PROMPT + [9], b"", 0) == 2 * BS
    ids, physical = _table(60, 4)
    planner.allocated("b", ids, 2 * BS, physical)
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    assert [o.key for o in planner.plan_step([]).loads] == [keys[0], checkpoint_key(keys[1])]
    planner.check_invariants()


def test_a_prefetch_brings_the_checkpoint_copy_its_run_ends_on():
    """Another process left blocks 0-2 and block 1's checkpoint copy on disk: an
    arriving request's prefetch reads the checkpoint copy into host memory with the
    blocks, so its hit loads from host only."""
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    on_disk = {*keys, checkpoint_key(keys[1])}
    planner = TierPlanner(BS, DIGEST, host_capacity=8, disk_contains=on_disk.__contains__,
                          prefetch_step_blocks=8, state_groups=(0,))
    assert planner.prefetch("b", PROMPT + [9], b"") == 4
    assert planner.plan_step([]).prefetches == (*((key, False) for key in keys),
                                                (checkpoint_key(keys[1]), True))
    planner.step_finished(())
    assert planner.lookup("b", PROMPT + [9], b"", 0) == 2 * BS
    ids, physical = _table(70, 4)
    planner.allocated("b", ids, 2 * BS, physical)
    assert planner.hit_sources("b", 2 * BS) == {Source.HOST: 2 * BS}
    planner.check_invariants()


def test_checkpoint_copies_in_the_remote_tier_are_probed_in_one_round_trip():
    """Every block of a ten-block prompt is in the remote tier, only block 2 with a
    checkpoint copy: the hit is three blocks, ending on that copy, found with one
    round trip for the blocks and one for the checkpoint copies of blocks 9 to 0
    (before: one round trip per copy, from block 9 down to block 2)."""
    tokens = list(range(50, 50 + 10 * BS + 1))
    keys = compute_block_keys(tokens, BS, DIGEST)
    remote = Remote([*keys, checkpoint_key(keys[2])])
    planner = TierPlanner(BS, DIGEST, host_capacity=0, disk_contains=None,
                          remote_contains=remote, remote_step_blocks=100, state_groups=(0,))
    assert planner.lookup("a", tokens, b"", 0) == 3 * BS
    assert remote.asked == [keys, [checkpoint_key(k) for k in reversed(keys)]]
    ids, physical = _table(1, 11)
    planner.allocated("a", ids, 3 * BS, physical)
    assert planner.hit_sources("a", 3 * BS) == {Source.REMOTE: 3 * BS}
    last = planner.plan_step([]).loads[-1]
    assert (last.key, last.checkpoint) == (checkpoint_key(keys[2]), True)
    planner.check_invariants()


def test_a_remote_checkpoint_copy_past_the_budget_is_not_probed():
    """The step's remote budget is spent: a block from disk may still end the hit on a
    checkpoint copy held locally, and none held only remotely is asked for."""
    tokens = list(range(50, 50 + 4 * BS + 1))
    keys = compute_block_keys(tokens, BS, DIGEST)
    remote = Remote([checkpoint_key(k) for k in keys])
    on_disk = {*keys, checkpoint_key(keys[0])}
    planner = TierPlanner(BS, DIGEST, host_capacity=0, disk_contains=on_disk.__contains__,
                          remote_contains=remote, remote_step_blocks=0, state_groups=(0,))
    assert planner.lookup("a", tokens, b"", 0) == BS
    assert remote.asked == []
    planner.check_invariants()


def test_a_step_ending_inside_a_recorded_block_unrecords_its_checkpoint():
    """A request resumes from a host hit of two blocks and its step ends on block 2's
    boundary while it loads (its saves wait). The load fails; vLLM recomputes the
    request from its first token, and a step ends inside block 2, whose state page
    then holds a state from inside the block: block 2 is saved without a checkpoint
    copy. Before the fix the stale record saved that state as block 2's checkpoint
    (found by the hybrid planner machine)."""
    planner = _planner()
    keys = compute_block_keys(PROMPT, BS, DIGEST)
    _prefill(planner, "a", PROMPT[:2 * BS], [2 * BS])  # blocks 0, 1 and 1's checkpoint
    planner.request_finished("a", 0)
    assert planner.lookup("b", PROMPT, b"", 0) == 2 * BS
    ids, physical = _table(10, 4)
    planner.allocated("b", ids, 2 * BS, physical)
    orders = planner.plan_step([ScheduledRequest("b", 2 * BS, BS, ids, physical)])
    assert not orders.saves  # it loads in this step: its saves wait
    planner.step_finished({ids[1]})  # the checkpoint copy's load failed
    saves = []
    for start, end in ((0, 2 * BS + 2), (2 * BS + 2, 3 * BS + 1)):
        saves += planner.plan_step([ScheduledRequest("b", start, end - start, ids,
                                                     physical)]).saves
        planner.step_finished(())
        planner.check_invariants()
    assert [(o.key, o.checkpoint) for o in saves if o.block_id == ids[2]] == [(keys[2], False)]
