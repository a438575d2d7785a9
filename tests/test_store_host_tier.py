"""HostTier against a plain dict + list LRU model (hypothesis stateful) and edge cases."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.store.host_tier import HostTier
from kvbackend.store.tier import TierStore
from tests.store_helpers import key_of

KEYS = [key_of(i) for i in range(8)]
MAX = 100


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tier = HostTier(MAX)
        self.data: dict[str, bytes] = {}
        self.order: list[str] = []  # least recently used first

    def _touch(self, key):
        self.order.remove(key)
        self.order.append(key)

    def _drop_lru_until(self, limit):
        while sum(len(self.data[k]) for k in self.order) > limit:
            del self.data[self.order.pop(0)]

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 120), as_array=st.booleans())
    def put(self, key, size, as_array):
        payload = bytes([KEYS.index(key)]) * size
        stored = np.frombuffer(payload, np.uint8) if as_array else payload
        if key in self.data:
            del self.data[key]
            self.order.remove(key)
        ok = size <= MAX
        if ok:
            self._drop_lru_until(MAX - size)
            self.data[key] = payload
            self.order.append(key)
        assert self.tier.put(key, stored, 16) is ok

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        got = self.tier.get(key)
        if key in self.data:
            assert bytes(got) == self.data[key]
            self._touch(key)
        else:
            assert got is None

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def contains_prefix(self, keys):
        expected = 0
        for k in keys:
            if k not in self.data:
                break
            expected += 1
        assert self.tier.contains_prefix(keys) == expected

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        assert self.tier.remove(key) is (key in self.data)
        if key in self.data:
            del self.data[key]
            self.order.remove(key)

    @precondition(lambda self: self.data)
    @rule(limit=st.integers(-5, MAX))
    def evict_to(self, limit):
        before = len(self.order)
        self._drop_lru_until(max(0, limit))
        assert self.tier.evict_to(limit) == before - len(self.order)

    @invariant()
    def matches_model(self):
        self.tier.check_invariants()
        assert self.tier.keys_lru() == self.order
        assert self.tier.bytes_used == sum(len(v) for v in self.data.values())
        assert all(self.tier.contains(k) is (k in self.data) for k in KEYS)


TestHostTierStateful = HostTierMachine.TestCase


def test_bytearray_and_memoryview_are_copied():
    tier = HostTier(100)
    buf = bytearray(b"abc")
    tier.put(KEYS[0], buf, 1)
    tier.put(KEYS[1], memoryview(buf), 1)
    buf[0] = ord("z")
    assert tier.get(KEYS[0]) == b"abc" and tier.get(KEYS[1]) == b"abc"
    assert isinstance(tier, TierStore) and tier.num_tokens(KEYS[0]) == 1


def test_check_invariants_catches_broken_accounting():
    tier = HostTier(100)
    tier.put(KEYS[0], b"x" * 10, 1)
    tier._lru._bytes += 1
    with pytest.raises(RuntimeError, match="bytes accounted 11 != sum of payloads 10"):
        tier.check_invariants()


def test_stats_and_errors():
    tier = HostTier(10)
    assert not tier.put(KEYS[0], b"x" * 11, 1)
    tier.put(KEYS[0], b"x", 1)
    tier.get(KEYS[0]), tier.get(KEYS[1])
    s = tier.stats()
    assert (s["hits"], s["misses"], s["rejected"], s["entries"], s["bytes"]) == (1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got -1"):
        HostTier(-1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -2"):
        tier.put(KEYS[0], b"x", -2)
