"""PinnedRows: fixed-size rows in power-of-two slabs, freed when nothing references them."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

torch = pytest.importorskip("torch")

from kvbackend.ops.pinned_rows import ROWS_PER_SLAB, PinnedRows  # noqa: E402

ROW = 40  # bytes


def _stamp(row: np.ndarray, number: int) -> None:
    row[:] = np.arange(number, number + row.nbytes, dtype=np.int64) % 251


def _has_stamp(view, number: int) -> bool:
    got = np.frombuffer(memoryview(view).cast("B"), dtype=np.uint8) \
        if not isinstance(view, torch.Tensor) else view.numpy()
    return np.array_equal(got, np.arange(number, number + ROW, dtype=np.int64) % 251)


class PinnedRowsMachine(RuleBasedStateMachine):
    """Rows are taken, stamped, turned into derived views (numpy views, memoryviews,
    tensors) and dropped in any order: no slot is handed out while anything made from
    its row is alive, and the pool's slots are exactly the free and the held ones."""

    refs = Bundle("refs")

    def __init__(self):
        super().__init__()
        self.pool = PinnedRows(ROW, pin=False)
        self.alive: dict[int, list] = {}  # row number -> the references kept to it
        self.taken = 0

    @rule(target=refs)
    def take(self):
        row = self.pool.take()
        assert row.nbytes == ROW and row.flags.writeable
        number, self.taken = self.taken, self.taken + 1
        _stamp(row, number)
        self.alive[number] = [row]
        return number

    @rule(number=refs, kind=st.sampled_from(["slice", "reshape", "memoryview", "tensor"]))
    def derive_and_drop_the_row(self, number, kind):
        """Keep only something made from the row (the row itself is dropped)."""
        refs = self.alive.get(number)
        if not refs:
            return
        ref = refs[0]  # the row, or what an earlier rule made from it
        row = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
        derived = {"slice": lambda: row[:],
                   "reshape": lambda: np.ascontiguousarray(row).reshape(-1).view(np.uint8),
                   "memoryview": lambda: memoryview(row),
                   "tensor": lambda: torch.from_numpy(row)}[kind]()
        refs[:] = [derived]

    @rule(number=consumes(refs))
    def drop(self, number):
        self.alive.pop(number, None)

    @invariant()
    def nothing_alive_was_handed_out_again(self):
        self.pool.check_invariants()
        assert self.pool.rows_in_use == len(self.alive)
        for number, refs in self.alive.items():
            assert all(_has_stamp(ref, number) for ref in refs)


TestPinnedRowsMachine = PinnedRowsMachine.TestCase


def test_slabs_are_powers_of_two_holding_at_least_rows_per_slab_rows():
    """5000-byte rows: slabs of 2^18 bytes hold 52 rows; the 53rd row opens a second slab;
    the bytes held stay within 1/32 of the rows' bytes (pinned one by one, torch would
    round each row up to 8192 bytes)."""
    pool = PinnedRows(5000, pin=False)
    assert (pool.slab_nbytes, pool.rows_per_slab) == (1 << 18, 52)
    rows = [pool.take() for _ in range(52)]
    assert pool.pinned_nbytes == 1 << 18
    assert pool.pinned_nbytes <= pool.rows_in_use * 5000 * (1 + 1 / ROWS_PER_SLAB)
    rows.append(pool.take())
    assert pool.pinned_nbytes == 2 << 18 and pool.rows_in_use == 53
    del rows
    assert pool.rows_in_use == 0
    pool.check_invariants()
    with pytest.raises(ValueError, match="row_nbytes must be a positive int"):
        PinnedRows(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_are_pinned_and_copy_to_the_gpu_and_back():
    pool = PinnedRows(3 * 2**20 + 8)
    rows = [pool.take() for _ in range(3)]
    for number, row in enumerate(rows):
        source = torch.from_numpy(row)
        assert source.is_pinned()
        source.copy_(torch.arange(row.nbytes) % (number + 7))
        back = torch.empty_like(source)
        back.copy_(source.cuda(non_blocking=True), non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, source)
