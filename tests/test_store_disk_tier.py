"""DiskTier on real files: round trip, corruption, crashes, LRU bound, full/unwritable disks."""

import errno
import logging
import os
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvbackend.store import block_file
from kvbackend.store.block_file import HEADER_LEN
from kvbackend.store.disk_tier import FORMAT_DIR, DiskTier
from kvbackend.store.layout import block_path
from kvbackend.store.safe_fs import opened_dir
from kvbackend.store.scan import verify_file
from kvbackend.store.tier import TierStore
from tests.store_helpers import key_of, make_identity, payload_for

ID = make_identity()
BLOCK = 4096
FILE = HEADER_LEN + BLOCK


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    yield tier
    tier.check_invariants()


def files_of(tier, suffix=".kvb"):
    return sorted(p for p in _walk(tier.base) if p.endswith(suffix))


def _walk(base):
    for root, _, names in os.walk(base):
        for name in names:
            yield os.path.join(root, name)


def warnings_of(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING]


# ------------------------------------------------------------------ round trip
@pytest.mark.parametrize("kind", ["bytes", "memoryview", "ndarray", "strided"])
def test_round_trip(tier, kind):
    data = payload_for(key_of(0), BLOCK)
    arr = np.frombuffer(data, dtype=np.float16).reshape(32, 64)
    payload = {"bytes": data, "memoryview": memoryview(data), "ndarray": arr,
               "strided": np.ascontiguousarray(arr.T).T}[kind]  # non-contiguous view
    expected = data if kind != "strided" else np.ascontiguousarray(payload).tobytes()
    assert tier.put(key_of(0), payload, 16)
    assert tier.contains(key_of(0)) and tier.get(key_of(0)) == expected
    assert verify_file(files_of(tier)[0], ID.digest(), key_of(0)).num_tokens == 16
    assert open(files_of(tier)[0], "rb").read()[HEADER_LEN:] == expected
    assert isinstance(tier, TierStore)


def test_get_into_fills_the_callers_buffer(tier):
    data = payload_for(key_of(0), BLOCK)
    assert tier.put(key_of(0), data, 16)
    out = np.zeros(BLOCK, dtype=np.uint8)
    assert tier.get_into(key_of(0), out) == 16 and out.tobytes() == data
    assert tier.get_into(key_of(1), out) is None  # a miss
    assert tier.stats()["hits"] == 1 and tier.stats()["misses"] == 1
    with pytest.raises(ValueError, match="writable"):
        tier.get_into(key_of(0), data)
    assert tier.get_into(key_of(0), bytearray(BLOCK - 1)) is None  # another size: a miss
    assert len(files_of(tier)) == 1 and tier.stats()["corrupt"] == 0


def test_survives_restart_and_shares_with_new_instance(tmp_path, tier):
    for i in range(3):
        assert tier.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    again = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    assert len(again) == 3 and again.bytes_used == 3 * FILE
    assert all(again.get(key_of(i)) == payload_for(key_of(i), BLOCK) for i in range(3))
    assert again.contains_prefix([key_of(0), key_of(1), key_of(7), key_of(2)]) == 2


def test_other_identity_does_not_see_blocks(tmp_path, tier):
    tier.put(key_of(0), b"x" * 10, 16)
    other = DiskTier(tmp_path / "cache", 10 * FILE, make_identity(kv_dtype="float16"))
    assert not other.contains(key_of(0)) and other.get(key_of(0)) is None


def test_older_format_tree_is_never_read_nor_touched(tmp_path, tier):
    tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    old = tmp_path / "cache" / "v1"
    os.rename(tmp_path / "cache" / FORMAT_DIR, old)  # as format 1 left it
    old_files = sorted(_walk(old))
    fresh = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    assert len(fresh) == 0 and fresh.get(key_of(0)) is None and not fresh.contains(key_of(0))
    assert fresh.put(key_of(1), payload_for(key_of(1), BLOCK), 16)
    assert fresh.evict_to(0) == 1 and sorted(_walk(old)) == old_files


def test_put_existing_key_is_a_no_op(tier):
    assert tier.put(key_of(0), b"a" * 100, 16)
    mtime = os.stat(files_of(tier)[0]).st_mtime_ns
    assert tier.put(key_of(0), b"a" * 100, 16)
    assert tier.stats()["puts"] == 1 and os.stat(files_of(tier)[0]).st_mtime_ns == mtime


def test_caller_errors_raise(tier):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        tier.put("nothex", b"x", 1)
    with pytest.raises(ValueError, match=r"num_tokens must lie in \[0, 4294967295\], got -1"):
        tier.put(key_of(0), b"x", -1)
    with pytest.raises(TypeError, match="plain data"):
        tier.put(key_of(0), np.array([object()]), 1)


# ------------------------------------------------------------------ corruption
def _corrupt(path, how, tmp_path):
    data = bytearray(open(path, "rb").read())
    if how == "payload-byte":
        data[HEADER_LEN + 100] ^= 0x01
    elif how == "num-tokens":
        data[80] ^= 0x01
    elif how == "checksum":
        data[100] ^= 0x80
    elif how == "truncated":
        data = data[: len(data) - 7]
    elif how == "short-header":
        data = data[:50]
    elif how == "empty":
        data = b""
    elif how == "magic":
        data[0:8] = b"GARBAGE!"
    elif how == "version":
        data[8:10] = struct.pack("<H", block_file.FORMAT_VERSION + 1)
    elif how == "header-len":
        data[10:12] = struct.pack("<H", 256)
    elif how == "appended":
        data += b"\0" * 16
    with open(path, "wb") as f:
        f.write(data)


CORRUPTIONS = ["payload-byte", "num-tokens", "checksum", "truncated", "short-header", "empty",
               "magic", "version", "header-len", "appended"]


def get_into(tier, key):
    """``tier.get_into`` into a fresh buffer of one block: the payload, or None."""
    out = np.empty(BLOCK, dtype=np.uint8)
    return None if tier.get_into(key, out) is None else out.tobytes()


@pytest.mark.parametrize("read", [DiskTier.get, get_into])
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_file_is_a_miss_and_removed(tier, tmp_path, caplog, how, read):
    tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    path = files_of(tier)[0]
    _corrupt(path, how, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        assert read(tier, key_of(0)) is None
    assert not os.path.exists(path) and len(tier) == 0 and tier.bytes_used == 0
    assert tier.stats()["corrupt"] == 1 and len(warnings_of(caplog)) == 1
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)  # heals
    assert tier.get(key_of(0)) == payload_for(key_of(0), BLOCK)


def test_wrong_identity_and_wrong_key_are_misses(tmp_path, tier, caplog):
    other = DiskTier(tmp_path / "cache", 10 * FILE, make_identity(model="cd" * 32))
    other.put(key_of(0), b"theirs" * 10, 16)
    tier.put(key_of(1), b"mine" * 10, 16)
    theirs = files_of(other)[0]
    mine_path = files_of(tier)[0]
    # a file of another identity placed at our path for key 0
    target = block_path(tier.base, key_of(0))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.link(theirs, target)
    # a valid file of ours for key 1 placed under key 2's name
    wrong_name = block_path(tier.base, key_of(2))
    os.makedirs(os.path.dirname(wrong_name), exist_ok=True)
    os.link(mine_path, wrong_name)
    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        assert tier.get(key_of(0)) is None and tier.get(key_of(2)) is None
    assert not os.path.exists(target) and os.path.exists(theirs)
    assert tier.get(key_of(1)) == b"mine" * 10 and other.get(key_of(0)) == b"theirs" * 10
    assert len(warnings_of(caplog)) == 1  # once per kind of problem
    assert "identity" in caplog.text


def test_bad_file_replaced_meanwhile_is_not_deleted(tier, tmp_path):
    """The reader deletes only the inode it read; a fresh rewrite survives."""
    tier.put(key_of(0), b"good" * 10, 16)
    path = files_of(tier)[0]
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
    os.replace(path, path + ".old")
    tier.put(key_of(0), b"good" * 10, 16)  # another process rewrites it
    with opened_dir(os.path.dirname(path)) as fd:
        tier._discard_bad(key_of(0), fd, st, "checksum mismatch (simulated)")
    assert os.path.exists(path) and tier.get(key_of(0)) == b"good" * 10


# ------------------------------------------------------------------ crashes
def test_partial_temp_file_is_never_read(tmp_path, tier):
    tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    path = files_of(tier)[0]
    data = open(path, "rb").read()
    os.unlink(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.999.abcd1234.tmp")
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2])
    fresh = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    assert fresh.get(key_of(0)) is None and not fresh.contains(key_of(0)) and len(fresh) == 0
    assert os.path.exists(tmp)  # young temp files may be another process's write
    DiskTier(tmp_path / "cache", 10 * FILE, ID, stale_tmp_age_s=0)
    assert not os.path.exists(tmp)


def test_new_directories_are_fsynced_into_their_parent(tmp_path, monkeypatch):
    synced = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    tier = DiskTier(tmp_path / "new" / "cache", 10 * FILE, ID)
    assert tier.put(key_of(0), b"x" * 10, 16)
    block = block_path(tier.base, key_of(0))
    created = [tmp_path / "new", tmp_path / "new" / "cache", tmp_path / "new" / "cache" / "v2",
               tier.base, os.path.dirname(block)]
    unsynced = [str(d) for d in created if os.stat(os.path.dirname(d)).st_ino not in synced]
    assert not unsynced and os.stat(os.path.dirname(block)).st_ino in synced


_CHILD_HALF_WRITE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from kvbackend.store.disk_tier import DiskTier
    from store_helpers import make_identity, key_of, payload_for
    tier = DiskTier({cache!r}, 10**7, make_identity())
    real_write, calls = os.write, []
    def dying_write(fd, data):
        calls.append(1)
        if len(calls) == 2:  # header written; die halfway through the payload
            real_write(fd, bytes(data)[: len(data) // 2])
            os._exit(3)
        return real_write(fd, data)
    os.write = dying_write
    tier.put(key_of(0), payload_for(key_of(0), 4096), 16)
    os._exit(0)
""")


def test_process_dying_mid_put_leaves_nothing_readable(tmp_path):
    cache = str(tmp_path / "cache")
    code = _CHILD_HALF_WRITE.format(tests=os.path.dirname(__file__), cache=cache)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 3
    tier = DiskTier(cache, 10**7, ID)
    assert tier.get(key_of(0)) is None and len(tier) == 0
    assert len(files_of(tier, ".tmp")) == 1 and not files_of(tier)


_CHILD_LOOP = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from kvbackend.store.disk_tier import DiskTier
    from store_helpers import make_identity, key_of, payload_for
    tier = DiskTier({cache!r}, 10**9, make_identity(), durable=False)
    print("ready", flush=True)
    i = 0
    while True:
        tier.put(key_of(i), payload_for(key_of(i), 256 * 1024), 16)
        i += 1
""")


def test_sigkill_during_writes_never_leaves_a_bad_block(tmp_path):
    cache = str(tmp_path / "cache")
    code = _CHILD_LOOP.format(tests=os.path.dirname(__file__), cache=cache)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.4)
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()
    tier = DiskTier(cache, 10**9, ID)
    blocks = files_of(tier)
    assert blocks, "the child wrote nothing before it was killed"
    for path in blocks:
        key = os.path.basename(path)[:64]
        verify_file(path, ID.digest(), key)
        assert tier.get(key) == payload_for(key, 256 * 1024)


# ------------------------------------------------------------------ LRU bound
def test_lru_eviction_by_bytes(tmp_path):
    tier = DiskTier(tmp_path / "cache", 3 * FILE, ID)
    for i in range(3):
        assert tier.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    assert tier.get(key_of(0)) is not None  # 0 becomes most recent; 1 is LRU
    assert tier.put(key_of(3), payload_for(key_of(3), BLOCK), 16)
    assert not tier.contains(key_of(1))
    assert all(tier.contains(key_of(i)) for i in (0, 2, 3))
    assert tier.bytes_used == 3 * FILE == sum(os.path.getsize(p) for p in files_of(tier))
    assert tier.stats()["evictions"] == 1
    assert not tier.put(key_of(9), b"x" * (3 * FILE), 16)  # larger than the whole tier
    assert tier.evict_to(FILE) == 2 and len(files_of(tier)) == 1


def test_restart_order_comes_from_mtime(tmp_path):
    tier = DiskTier(tmp_path / "cache", 3 * FILE, ID)
    for i in range(3):
        tier.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    now = time.time_ns()
    for age, i in enumerate([1, 2, 0]):  # key 1 newest ... key 0 oldest
        path = block_path(tier.base, key_of(i))
        os.utime(path, ns=(now - age * 10**9, now - age * 10**9))
    again = DiskTier(tmp_path / "cache", 3 * FILE, ID)
    assert again.keys_lru() == [key_of(0), key_of(2), key_of(1)]
    again.put(key_of(3), payload_for(key_of(3), BLOCK), 16)
    assert not again.contains(key_of(0)) and again.contains(key_of(2))


def test_hit_touches_mtime_for_other_processes(tmp_path, tier):
    tier.put(key_of(0), b"x" * 10, 16)
    path = files_of(tier)[0]
    os.utime(path, ns=(1, 1))
    tier.get(key_of(0))
    assert os.stat(path).st_mtime_ns > 1


def test_vanished_file_is_a_miss(tier):
    tier.put(key_of(0), b"x" * 10, 16)
    os.unlink(files_of(tier)[0])  # another process evicted it
    assert tier.get(key_of(0)) is None and len(tier) == 0
    tier.put(key_of(1), b"y" * 10, 16)
    os.unlink(files_of(tier)[0])
    assert tier.evict_to(0) == 1  # unlink of a missing file is not an error


# ------------------------------------------------------------------ environment failures
def test_full_disk_put_returns_false_evicts_and_retries(tmp_path, monkeypatch, caplog):
    """(On a real full filesystem: tests/test_store_disk_faults.py.)"""
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID, backoff_s=0.0)
    for i in (0, 1):
        tier.put(key_of(i), b"old" * 10, 16)
    tier.put(key_of(9), b"kept" * 10, 16)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        with monkeypatch.context() as m:
            m.setattr(os, "write", full)
            assert tier.put(key_of(2), b"new" * 10, 16) is False
            assert tier.put(key_of(3), b"new" * 10, 16) is False
    assert len(warnings_of(caplog)) == 1 and "filesystem full" in caplog.text
    assert not files_of(tier, ".tmp") and not tier.contains(key_of(2))
    assert tier.keys_lru() == [key_of(9)]  # each failure made room: one LRU block
    assert tier.get(key_of(9)) == b"kept" * 10 and tier.mode == "rw"
    assert tier.stats()["put_failures"] == 2
    assert tier.put(key_of(2), b"new" * 10, 16)  # space is back


def test_full_disk_backoff_skips_writes(tier, monkeypatch):
    calls = []

    def full(fd, data):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        assert not tier.put(key_of(1), b"a", 1) and not tier.put(key_of(2), b"a", 1)
    assert len(calls) == 1 and not tier.put(key_of(3), b"a", 1)  # still backing off


def _fail_file_creation(patch, code: int) -> None:
    """Make every ``os.open`` that would create a file fail with ``code``."""
    real_open = os.open

    def failing_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args, **kwargs)

    patch.setattr(os, "open", failing_open)


def test_unwritable_filesystem_backs_off_and_recovers(tmp_path, monkeypatch, caplog):
    """(A real read-only mount: tests/test_store_disk_faults.py.)"""
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID, backoff_s=0.05, max_backoff_s=0.05)
    tier.put(key_of(0), b"kept" * 10, 16)
    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        with monkeypatch.context() as m:
            _fail_file_creation(m, errno.EROFS)
            assert tier.put(key_of(1), b"x", 1) is False
    assert tier.mode == "rw" and "retried after" in caplog.text
    assert tier.get(key_of(0)) == b"kept" * 10
    assert not tier.put(key_of(1), b"x", 1)  # backing off
    time.sleep(0.06)
    assert tier.put(key_of(1), b"x", 1) and tier.evict_to(0) == 2


def test_directory_under_a_regular_file_disables_the_tier(tmp_path, caplog):
    """Fails for root too: a path component is a file (ENOTDIR)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        tier = DiskTier(blocker / "cache", 10 * FILE, ID)
    assert tier.mode == "disabled" and "disabled" in caplog.text
    assert tier.put(key_of(0), b"x", 1) is False
    assert tier.get(key_of(0)) is None and not tier.contains(key_of(0))
    assert tier.contains_prefix([key_of(0)]) == 0 and tier.evict_to(0) == 0


def test_unwritable_existing_cache_is_served_read_only(tmp_path, tier, monkeypatch, caplog):
    tier.put(key_of(0), b"kept" * 10, 16)
    with caplog.at_level(logging.WARNING, logger="kvbackend.store"):
        with monkeypatch.context() as m:
            _fail_file_creation(m, errno.EACCES)
            ro = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    assert ro.mode == "ro" and "read-only" in caplog.text
    assert ro.get(key_of(0)) == b"kept" * 10 and not ro.put(key_of(1), b"x", 1)


def test_explicit_read_only_never_writes(tmp_path, tier):
    tier.put(key_of(0), b"kept" * 10, 16)
    ro = DiskTier(tmp_path / "cache", FILE, ID, read_only=True)
    before = files_of(tier)
    assert ro.get(key_of(0)) == b"kept" * 10 and not ro.put(key_of(1), b"x", 1)
    assert ro.evict_to(0) == 0 and files_of(tier) == before


def test_get_record_reports_partial_block_tokens(tier):
    tier.put(key_of(0), b"tail" * 8, 5)
    record = tier.get_record(key_of(0))
    assert record.num_tokens == 5 and record.payload == b"tail" * 8 and record.key == key_of(0)


def test_read_only_tier_does_not_delete_bad_files(tmp_path, tier):
    tier.put(key_of(0), b"x" * 1000, 16)
    path = files_of(tier)[0]
    _corrupt(path, "payload-byte", tmp_path)
    ro = DiskTier(tmp_path / "cache", 10 * FILE, ID, read_only=True)
    assert ro.get(key_of(0)) is None and os.path.exists(path)


def test_check_invariants_names_a_broken_count(tier):
    tier.put(key_of(1), payload_for(key_of(1), BLOCK), 16)
    tier.check_invariants()
    tier._counters["hits"] = -1
    with pytest.raises(RuntimeError, match="negative counters"):
        tier.check_invariants()
    tier._counters["hits"] = 0
    tier._index._lru._bytes += 1
    with pytest.raises(RuntimeError, match="bytes is"):
        tier.check_invariants()
    tier._index._lru._bytes -= 1
