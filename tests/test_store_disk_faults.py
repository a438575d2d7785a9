"""The disk tier under transient faults and several processes: a full filesystem, an
unwritable subdirectory, writers killed mid-write, writers with different bounds.

Real filesystems (small tmpfs mounts; skipped where mounting is not permitted)
and real processes.
"""

import contextlib
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvbackend.store.block_file import HEADER_LEN
from kvbackend.store.layout import block_path
from kvbackend.store.disk_tier import DiskTier
from tests.store_helpers import ROOT, key_of, make_identity, payload_for, tree_files

ID = make_identity()
BLOCK = 256 * 1024
FILE = HEADER_LEN + BLOCK


@contextlib.contextmanager
def tmpfs(path, *options):
    """A real tmpfs mounted at ``path`` (skips the test where mounting is not permitted)."""
    os.makedirs(path, exist_ok=True)
    opts = ",".join(options)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def put_until(tier: DiskTier, key: str, timeout: float = 10.0) -> bool:
    """``put`` retried until it succeeds (a backing-off tier refuses for a while)."""
    deadline = time.monotonic() + timeout
    while not tier.put(key, payload_for(key, BLOCK), 16):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------ full filesystem
def test_full_filesystem_evicts_its_own_blocks_and_keeps_writing(tmp_path):
    """A bound larger than the filesystem: the tier fills it, then makes room by
    evicting its own least recently used blocks; it never turns read-only."""
    with tmpfs(tmp_path / "fs", "size=2m", "mode=0700") as fs:
        tier = DiskTier(fs, 10**9, ID, backoff_s=0.01, max_backoff_s=0.05)
        keys = [key_of(i) for i in range(24)]  # 24 x 256 KiB: three times the filesystem
        for key in keys:
            assert put_until(tier, key), f"stuck at {key[:8]}: {tier.stats()}"
        assert tier.mode == "rw" and tier.stats()["put_failures"] >= 1
        assert all(tier.get(k) == payload_for(k, BLOCK) for k in keys[-3:])
        assert tier.bytes_used == sum(os.path.getsize(p) for p in tree_files(fs, ".kvb"))
        assert not tree_files(fs, ".tmp")


def test_full_filesystem_recovers_when_space_comes_back(tmp_path):
    with tmpfs(tmp_path / "fs", "size=2m", "mode=0700") as fs:
        tier = DiskTier(fs, 10**9, ID, backoff_s=0.01, max_backoff_s=0.05)
        ballast = os.path.join(fs, "ballast")
        with open(ballast, "wb", buffering=0) as f:  # someone else fills the filesystem
            with contextlib.suppress(OSError):
                while f.write(b"\0" * 65536):
                    pass
        assert not tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
        assert tier.mode == "rw" and tier.get(key_of(0)) is None
        os.unlink(ballast)
        assert put_until(tier, key_of(0)) and tier.get(key_of(0)) == payload_for(key_of(0), BLOCK)


def test_one_unwritable_subdirectory_does_not_stop_the_others(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 10**9, ID, backoff_s=0.01, max_backoff_s=0.05)
    stuck = key_of(0)
    free = next(key_of(i) for i in range(1, 100) if key_of(i)[:2] != stuck[:2])
    sub = os.path.dirname(block_path(tier.base, stuck))
    with tmpfs(sub, "ro", "size=1m"):  # EROFS in this subdirectory only, even for root
        assert not tier.put(stuck, payload_for(stuck, BLOCK), 16)
        assert tier.mode == "rw"
        assert tier.put(free, payload_for(free, BLOCK), 16)
        assert tier.get(free) == payload_for(free, BLOCK)
    assert put_until(tier, stuck) and tier.get(stuck) == payload_for(stuck, BLOCK)


# ------------------------------------------------------------------ kill -9
_WRITER = textwrap.dedent("""
    import sys
    from kvbackend.store.disk_tier import DiskTier
    from tests.store_helpers import key_of, make_identity, payload_for
    tier = DiskTier(sys.argv[1], 10**9, make_identity(), durable=False)
    print("ready", flush=True)
    i = int(sys.argv[2])
    while True:
        tier.put(key_of(i % 400), payload_for(key_of(i % 400), 64 * 1024), 16)
        i += 1
""")


def test_kill_9_loop_during_writes_never_serves_a_bad_block(tmp_path):
    """Writers are SIGKILLed mid-write again and again while a reader reads the same
    keys: every read is a miss or the exact payload, and every file left verifies."""
    cache = str(tmp_path / "cache")
    reader = DiskTier(cache, 10**9, ID)
    stop, wrong, hits = threading.Event(), [], [0]

    def read_loop():
        rng = random.Random(1)
        while not stop.is_set():
            key = key_of(rng.randrange(400))
            got = reader.get(key)
            if got is not None:
                hits[0] += 1
                if got != payload_for(key, 64 * 1024):
                    wrong.append(key)

    thread = threading.Thread(target=read_loop)
    thread.start()
    rng = random.Random(0)
    try:
        for round_ in range(8):
            proc = subprocess.Popen([sys.executable, "-c", _WRITER, cache, str(round_ * 50)],
                                    cwd=ROOT, stdout=subprocess.PIPE)
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.05, 0.3))
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not wrong and hits[0] > 0
    again = DiskTier(cache, 10**9, ID, stale_tmp_age_s=0)
    assert len(again) == len(tree_files(cache, ".kvb")) > 0
    assert all(again.get(k) in (None, payload_for(k, 64 * 1024)) for k in map(key_of, range(400)))
    assert again.stats()["corrupt"] == 0 and not tree_files(cache, ".tmp")


# ------------------------------------------------------------------ the bound across processes
def test_a_second_tier_with_a_smaller_bound_does_not_wipe_the_first(tmp_path):
    big = DiskTier(tmp_path / "cache", 20 * FILE, ID)
    for i in range(10):
        assert big.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    small = DiskTier(tmp_path / "cache", 2 * FILE, ID)
    assert small.put(key_of(10), payload_for(key_of(10), BLOCK), 16)
    assert all(big.get(key_of(i)) is not None for i in range(11))
    assert small.stats()["max_bytes"] == 2 * FILE and small.stats()["bound"] == 20 * FILE


def test_an_expired_declaration_no_longer_holds_the_bound(tmp_path):
    big = DiskTier(tmp_path / "cache", 20 * FILE, ID, bound_ttl_s=60)
    for i in range(10):
        big.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    big.close()  # a clean exit withdraws the declaration
    small = DiskTier(tmp_path / "cache", 4 * FILE, ID, bound_ttl_s=60)
    assert len(small) == 4 and small.stats()["bound"] == 4 * FILE
    crashed = DiskTier(tmp_path / "cache", 20 * FILE, ID, bound_ttl_s=60)
    for i in range(10):
        crashed.put(key_of(i), payload_for(key_of(i), BLOCK), 16)
    for path in tree_files(os.path.join(crashed.base, "bounds")):
        os.utime(path, (time.time() - 120, time.time() - 120))  # no heartbeat for 2 minutes
    small.rescan()
    assert len(small) == 4 and small.stats()["bound"] == 4 * FILE


_BOUNDED_WRITER = textwrap.dedent("""
    import sys
    from kvbackend.store.disk_tier import DiskTier
    from tests.store_helpers import key_of, make_identity, payload_for
    cache, name, bound, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    tier = DiskTier(cache, bound, make_identity(), rescan_interval_s=0.05)
    wrong = 0
    for i in range(30):
        for key in (key_of(i, name), key_of(i, "shared")):
            tier.put(key, payload_for(key, 8192), 16)
        for j in range(i + 1):
            got = tier.get(key_of(j, "shared"))
            wrong += got is not None and got != payload_for(key_of(j, "shared"), 8192)
    print("done", wrong, tier.stats()["corrupt"], flush=True)
    if hold:
        sys.stdin.read()  # stay alive (and declared) until the test closes stdin
""")


def test_writers_with_different_bounds_share_one_directory(tmp_path):
    """Two generous writers stay alive while a stingy one runs: the directory keeps
    the generous bound. Once they are gone, the stingy bound applies."""
    cache = str(tmp_path / "cache")
    file_size = HEADER_LEN + 8192
    big, small = 40 * file_size, 5 * file_size

    def start(name, bound, hold):
        return subprocess.Popen([sys.executable, "-c", _BOUNDED_WRITER, cache, name, str(bound),
                                 "1" if hold else "0"], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    generous = [start(f"big{i}", big, True) for i in range(2)]
    try:
        assert [p.stdout.readline().split() for p in generous] == [["done", "0", "0"]] * 2
        stingy = start("small", small, False)
        assert stingy.communicate(timeout=120)[0].split() == ["done", "0", "0"]
        time.sleep(0.5)  # the generous writers' rescans (every 0.05 s) settle the bound
        files = tree_files(cache, ".kvb")
        assert 5 < len(files) <= 40  # the generous bound held, not the stingy one
        reader = DiskTier(cache, big, ID, read_only=True)
        assert all(reader.get(os.path.basename(p)[:64]) is not None for p in files)
    finally:
        for proc in generous:
            proc.communicate(timeout=60)
    alone = DiskTier(cache, small, ID)
    assert len(alone) == 5 and len(tree_files(cache, ".kvb")) == 5


# ------------------------------------------------------------------ probe-only and rescans
def test_probe_only_tier_keeps_no_index(tmp_path):
    writer = DiskTier(tmp_path / "cache", 10**9, ID)
    for i in range(50):
        writer.put(key_of(i), b"x" * 100, 16)
    probe = DiskTier(tmp_path / "cache", 10**9, ID, probe_only=True)
    assert len(probe) == 0 and probe.keys_lru() == []  # no scan at start either
    assert all(probe.contains(key_of(i)) for i in range(50)) and not probe.contains(key_of(50))
    assert probe.contains_prefix([key_of(0), key_of(1), key_of(99), key_of(2)]) == 2
    assert len(probe) == 0 and probe.stats()["entries"] == 0
    assert not probe.put(key_of(60), b"y", 1) and probe.evict_to(0) == 0
    assert len(tree_files(tmp_path / "cache", ".kvb")) == 50


def test_rescans_run_on_a_background_thread_only(tmp_path):
    seen_on = []
    tier = DiskTier(tmp_path / "cache", 10**9, ID, rescan_interval_s=0.02)
    real = tier.rescan

    def spy():
        seen_on.append(threading.current_thread() is threading.main_thread())
        real()

    tier.rescan = spy
    other = DiskTier(tmp_path / "cache", 10**9, ID)
    for i in range(20):
        other.put(key_of(i), b"z" * 100, 16)
        tier.put(key_of(100 + i), b"w" * 100, 16)
        tier.get(key_of(100 + i))
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while len(tier) < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(tier) == 40  # the background rescan found the other writer's files
    assert seen_on and not any(seen_on)
    tier.close()
