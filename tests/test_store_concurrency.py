"""Several processes (multiprocessing, spawn) sharing one DiskTier directory."""

import multiprocessing as mp
import os

from kvbackend.store.scan import verify_file
from kvbackend.store.disk_tier import DiskTier
from tests.store_helpers import key_of, make_identity, payload_for

ID = make_identity()
SHARED = [key_of(i, "shared") for i in range(40)]
SIZE = 8192


def _own(worker: int) -> list[str]:
    return [key_of(i, f"own-{worker}") for i in range(40)]


def _worker(cache: str, worker: int, max_bytes: int) -> dict:
    """Writes shared and own keys interleaved, reads everything; returns problems found."""
    tier = DiskTier(cache, max_bytes, ID, rescan_interval_s=0.05)
    wrong, failed = 0, 0
    order = SHARED[worker::2] + SHARED[1 - worker::2]
    for shared, own in zip(order, _own(worker)):
        for key in (shared, own):
            failed += not tier.put(key, payload_for(key, SIZE), 16)
        for key in SHARED + _own(1 - worker):
            got = tier.get(key)
            wrong += got is not None and got != payload_for(key, SIZE)
    return dict(wrong=wrong, failed=failed, corrupt=tier.stats()["corrupt"])


def _run(cache: str, max_bytes: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        return pool.starmap(_worker, [(cache, 0, max_bytes), (cache, 1, max_bytes)])


def _all_blocks(cache: str):
    for root, _, names in os.walk(cache):
        for name in names:
            if name.endswith(".kvb"):
                yield os.path.join(root, name)


def test_two_processes_same_and_different_keys(tmp_path):
    cache = str(tmp_path / "cache")
    results = _run(cache, 10**8)
    assert all(r == dict(wrong=0, failed=0, corrupt=0) for r in results), results
    tier = DiskTier(cache, 10**8, ID)
    for path in _all_blocks(cache):
        key = os.path.basename(path)[:64]
        verify_file(path, ID.digest(), key)
        assert tier.get(key) == payload_for(key, SIZE)
    for key in SHARED + _own(0) + _own(1):
        assert tier.get(key) == payload_for(key, SIZE), key
    assert len(tier) == 120 and tier.stats()["corrupt"] == 0


def test_two_processes_racing_evictions(tmp_path):
    """A tight bound makes each process delete files the other is reading: only misses."""
    cache = str(tmp_path / "cache")
    results = _run(cache, 12 * (SIZE + 128))
    assert all(r["wrong"] == 0 and r["failed"] == 0 and r["corrupt"] == 0 for r in results), results
    blocks = list(_all_blocks(cache))
    reader = DiskTier(cache, 10**8, ID, read_only=True)
    for path in blocks:
        key = os.path.basename(path)[:64]
        verify_file(path, ID.digest(), key)
        assert reader.get(key) == payload_for(key, SIZE)
    assert len(blocks) <= 2 * 12  # each process's view is bounded; together at most twice
