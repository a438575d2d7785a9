"""DiskIndex against a brute-force model (a list of (key, size), oldest first), with
rebuilds open across any other operations; check_invariants after every step."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.store.disk_index import DiskIndex

KEYS = st.sampled_from([f"k{i}" for i in range(8)])
SIZES = st.integers(min_value=0, max_value=5000)


def model_apply(model: list[tuple[str, int]], key: str, size: int | None,
                only_if_absent: bool) -> None:
    present = [k for k, _ in model]
    if only_if_absent and key in present:
        return
    model[:] = [(k, s) for k, s in model if k != key]
    if size is not None:
        model.append((key, size))


class DiskIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex()
        self.model: list[tuple[str, int]] = []
        self.log: list[tuple[str, int | None, bool]] | None = None

    def _change(self, key: str, size: int | None, only_if_absent: bool) -> None:
        model_apply(self.model, key, size, only_if_absent)
        if self.log is not None:
            self.log.append((key, size, only_if_absent))

    @rule(key=KEYS, size=SIZES, only_if_absent=st.booleans())
    def touch(self, key, size, only_if_absent):
        self.index.touch(key, size, only_if_absent=only_if_absent)
        self._change(key, size, only_if_absent)

    @rule(key=KEYS)
    def refresh(self, key):
        """Most recently used with its size, if known; nothing otherwise."""
        self.index.refresh(key)
        size = dict(self.model).get(key)
        if size is not None:
            self._change(key, size, False)

    @rule(key=KEYS)
    def drop(self, key):
        assert self.index.drop(key) == (key in [k for k, _ in self.model])
        self._change(key, None, False)

    @rule(max_bytes=st.integers(min_value=-10, max_value=20000))
    def pop_lru(self, max_bytes):
        expected = []
        while sum(s for _, s in self.model) > max(0, max_bytes) and self.model:
            expected.append(self.model[0][0])
            self._change(self.model[0][0], None, False)
        assert self.index.pop_lru(max_bytes) == expected

    @precondition(lambda self: self.log is None)
    @rule()
    def begin_rebuild(self):
        self.index.begin_rebuild()
        self.log = []

    @precondition(lambda self: self.log is not None)
    @rule(found=st.lists(st.tuples(KEYS, SIZES), unique_by=lambda pair: pair[0]))
    def end_rebuild(self, found):
        """``found``: the directory as a scan saw it, at some moment since begin."""
        self.index.end_rebuild(found)
        self.model = list(found)
        for change in self.log:
            model_apply(self.model, *change)
        self.log = None

    @invariant()
    def matches_model(self):
        self.index.check_invariants()
        assert self.index.keys_lru() == [k for k, _ in self.model]
        assert self.index.bytes == sum(s for _, s in self.model)
        assert len(self.index) == len(self.model)


TestDiskIndex = DiskIndexMachine.TestCase


def test_rebuilds_do_not_nest():
    index = DiskIndex()
    index.begin_rebuild()
    with pytest.raises(RuntimeError, match="already open"):
        index.begin_rebuild()
    index.end_rebuild([])
    with pytest.raises(RuntimeError, match="without begin_rebuild"):
        index.end_rebuild([])
