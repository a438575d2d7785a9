"""Stateful property test of the host mirror's eviction order with retention and pins.

Checked against a model of which keys are held, pinned and retained until when, after
every step: the mirror's invariants; it holds exactly the model's keys, of their
weights (a hybrid model's checkpoint copies weigh more than its ordinary ones); an insert
is refused only when the unpinned keys cannot make room, never evicts a pinned key,
evicts no more than it needs and a retained key only once every unpinned ordinary key
went; retained keys come after every ordinary key in eviction order; no retention
outlives its time once ``expire`` ran; the retained keys weigh at most ``max_retained``,
and a retention ends over the bound only as far as the bound needs; a prefetch's insert
(``ordinary_only``) evicts only ordinary keys that are neither pinned nor arriving.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.vllm.tiers.host_mirror import HostMirror

CAPACITY = 9
MAX_RETAINED = 4
KEYS = st.sampled_from([f"k{i}" for i in range(10)])
WEIGHT = {f"k{i}": 1 + i % 3 for i in range(10)}  # one key, one payload: one weight


class HostMirrorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mirror = HostMirror(CAPACITY, MAX_RETAINED)
        self.held: set[str] = set()
        self.until: dict[str, float] = {}  # retained keys
        self.pins: Counter[str] = Counter()
        self.arriving: set[str] = set()  # inserted since the last orders_sent
        self.now = 0.0

    def weight(self, keys) -> int:
        return sum(WEIGHT[k] for k in keys)

    def check_insert(self, key: str, movable: set[str], ordinary_only: bool) -> None:
        """Insert ``key``, where only ``movable`` keys may be evicted, against the model."""
        was_held = set(self.held)
        added, evicted = self.mirror.insert(key, ordinary_only, WEIGHT[key])
        room = CAPACITY - self.weight(was_held)
        assert added == (key not in was_held and WEIGHT[key] <= room + self.weight(movable)), (
            "insert refused or accepted wrongly")
        assert set(evicted) <= movable, f"evicted {evicted}, only {movable} may go"
        if evicted:
            assert room + self.weight(evicted[:-1]) < WEIGHT[key], "evicted more than needed"
        if set(evicted) & set(self.until):
            assert movable - set(self.until) <= set(evicted), (
                f"evicted retained keys while an unpinned ordinary key was held: {evicted}")
        self.apply(key, added, evicted)

    @rule(key=KEYS)
    def insert(self, key: str) -> None:
        self.check_insert(key, {k for k in self.held if k not in self.pins}, False)

    @rule(key=KEYS)
    def prefetch(self, key: str) -> None:
        self.check_insert(key, {k for k in self.held if k not in self.pins
                                and k not in self.until and k not in self.arriving}, True)

    def apply(self, key: str, added: bool, evicted: tuple[str, ...]) -> None:
        for victim in evicted:
            self.held.discard(victim)
            self.until.pop(victim, None)
            self.arriving.discard(victim)
        if added:
            self.held.add(key)
            self.arriving.add(key)

    @rule(key=KEYS)
    def touch(self, key: str) -> None:
        self.mirror.touch(key)

    @rule(data=st.data())
    def pin_a_held_key(self, data) -> None:
        self.mirror.orders_sent()  # only keys the workers hold are pinned (host hits)
        self.arriving.clear()
        if self.held:
            key = data.draw(st.sampled_from(sorted(self.held)), label="pinned")
            self.mirror.pin(key)
            self.pins[key] += 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)), label="unpinned")
        self.mirror.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(keys=st.lists(KEYS, max_size=5, unique=True), retain_s=st.integers(1, 5))
    def retain(self, keys: list[str], retain_s: int) -> None:
        until = self.now + retain_s
        before = dict(self.until)
        self.mirror.retain(keys, until)
        for key in keys:
            if key in self.held:
                self.until[key] = max(until, self.until.get(key, until))
        retained = set(self.mirror.retained())
        ended = set(self.until) - retained  # over the bound: ended, least recent first
        for key in ended:
            del self.until[key]
        assert self.weight(retained) <= MAX_RETAINED, "retained keys weigh over the bound"
        assert not ended or self.weight(retained) + max(WEIGHT[k] for k in ended) > (
            MAX_RETAINED), "a retention ended below the bound"
        assert retained <= set(before) | set(keys), "a key was retained unasked"
        assert retained == set(self.until), "retained keys differ from the model's"

    @rule(dt=st.integers(0, 3))
    def time_passes(self, dt: int) -> None:
        self.now += dt
        self.mirror.expire(self.now)
        self.until = {k: t for k, t in self.until.items() if t > self.now}

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        if key in self.pins:
            return  # the planner removes only keys no request lists (failed loads)
        assert self.mirror.remove(key) == (key in self.held)
        self.held.discard(key)
        self.until.pop(key, None)
        self.arriving.discard(key)

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.mirror.check_invariants()
        assert set(self.mirror.keys()) == self.held
        assert self.mirror.used == self.weight(self.held) <= CAPACITY
        assert set(self.mirror.retained()) == set(self.until)
        assert all(self.mirror.pin_count(k) == n for k, n in self.pins.items())
        keys = self.mirror.keys()
        assert keys[len(keys) - len(self.until):] == self.mirror.retained(), (
            "a retained key is evicted before an ordinary one")


HostMirrorMachine.TestCase.settings = settings(HostMirrorMachine.TestCase.settings,
                                               stateful_step_count=25)
TestHostMirror = HostMirrorMachine.TestCase
