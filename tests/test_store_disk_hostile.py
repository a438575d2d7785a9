"""Hostile files in a disk-tier directory: FIFOs, symlinks, oversized headers, foreign names.

Each test plants real files (FIFOs, symlinks, sparse files) where a cooperating
writer would have put blocks, and checks that the tier neither hangs, nor reads
through a link, nor allocates what a header claims, nor deletes anything
outside the cache.
"""

import os
import textwrap
import time

import numpy as np
import pytest

from kvbackend.cli import main
from kvbackend.store.block_file import HEADER_LEN, encode_header
from kvbackend.store.layout import block_path
from kvbackend.store.disk_tier import FORMAT_DIR, DiskTier
from tests.store_helpers import key_of, make_identity, payload_for, run_python, tree_files

ID = make_identity()
BLOCK = 4096
FILE = HEADER_LEN + BLOCK


def block_bytes(key: str, payload: bytes, identity_digest: str = ID.digest()) -> bytes:
    """A valid block file's bytes, as a cooperating writer would write them."""
    return encode_header(identity_digest, key, 16, memoryview(payload)) + payload


def key_with_prefix_not_in(base: str, start: int = 0) -> str:
    """A key whose ``<key[:2]>`` subdirectory does not exist under ``base`` yet."""
    i = start
    while os.path.lexists(os.path.join(base, key_of(i)[:2])):
        i += 1
    return key_of(i)


def snapshot(root) -> dict[str, bytes]:
    return {p: open(p, "rb").read() for p in tree_files(root)}


def test_fifo_at_a_block_path_is_a_miss_not_a_hang(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the reader must never open it.
    Runs in a child so that a hang fails the test (timeout) instead of hanging the suite."""
    code = textwrap.dedent(f"""
        import os
        import numpy as np
        from kvbackend.store.layout import block_path
        from kvbackend.store.disk_tier import DiskTier
        from tests.store_helpers import key_of, make_identity
        tier = DiskTier({str(tmp_path / "cache")!r}, 10**7, make_identity())
        for i in (0, 1):
            path = block_path(tier.base, key_of(i))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkfifo(path)
        assert tier.get(key_of(0)) is None
        assert tier.get_into(key_of(1), np.empty(4096, dtype=np.uint8)) is None
        assert tier.contains(key_of(0)) is False
        assert not os.path.lexists(block_path(tier.base, key_of(0)))  # removed as junk
        print("ok", tier.stats()["corrupt"])
    """)
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "2"]


def test_symlinked_block_file_is_never_followed(tmp_path):
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    outside = tmp_path / "outside.kvb"
    outside.write_bytes(block_bytes(key_of(0), payload_for(key_of(0), BLOCK)))  # a valid block
    link = block_path(tier.base, key_of(0))
    os.makedirs(os.path.dirname(link))
    os.symlink(outside, link)
    assert tier.get(key_of(0)) is None and not tier.contains(key_of(0))
    out = np.empty(BLOCK, dtype=np.uint8)
    assert tier.get_into(key_of(0), out) is None
    assert outside.read_bytes() == block_bytes(key_of(0), payload_for(key_of(0), BLOCK))
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)  # replaces the link
    assert not os.path.islink(link) and tier.get(key_of(0)) == payload_for(key_of(0), BLOCK)
    assert outside.read_bytes() == block_bytes(key_of(0), payload_for(key_of(0), BLOCK))


def test_symlinked_subdirectory_is_never_descended_into(tmp_path):
    """Rescan, reads, writes, eviction and stale-temp cleaning stay inside the cache."""
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID, stale_tmp_age_s=0)
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    victim = key_with_prefix_not_in(tier.base, 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{victim}.kvb").write_bytes(block_bytes(victim, payload_for(victim, BLOCK)))
    (outside / f".{victim}.kvb.1.abcdef01.tmp").write_bytes(b"someone else's temp file")
    old = time.time() - 10 * 3600
    os.utime(outside / f".{victim}.kvb.1.abcdef01.tmp", (old, old))
    before = snapshot(outside)
    os.symlink(outside, os.path.join(tier.base, victim[:2]))

    again = DiskTier(tmp_path / "cache", 10 * FILE, ID, stale_tmp_age_s=0)
    assert again.keys_lru() == [key_of(0)]  # the linked directory was not scanned
    assert again.get(victim) is None
    assert not again.put(victim, payload_for(victim, BLOCK), 16)  # no write through the link
    assert again.evict_to(0) == 1 and again.get(key_of(0)) is None
    again.remove(victim)
    assert snapshot(outside) == before


def test_cli_clear_does_not_follow_links(tmp_path, capsys):
    root = tmp_path / "cache"
    tier = DiskTier(root, 10 * FILE, ID)
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    # an outside tree shaped like an identity directory, linked in as one
    outside = tmp_path / "outside"
    (outside / key_of(1)[:2]).mkdir(parents=True)
    (outside / key_of(1)[:2] / f"{key_of(1)}.kvb").write_bytes(b"precious")
    (outside / "identity.json").write_text("{}")
    os.symlink(outside, root / FORMAT_DIR / ("cd" * 32))
    # and an outside directory linked in as a key subdirectory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sub = key_with_prefix_not_in(tier.base, 2)
    (elsewhere / f"{sub}.kvb").write_bytes(b"precious too")
    os.symlink(elsewhere, os.path.join(tier.base, sub[:2]))
    before = snapshot(outside) | snapshot(elsewhere)
    assert main(["cache", "stats", str(root), "--json"]) == 0
    assert '"entries": 1' in capsys.readouterr().out
    assert main(["cache", "verify", str(root), "--no-progress", "--delete"]) == 0
    assert main(["cache", "clear", str(root)]) == 0
    assert "removed 1 block files" in capsys.readouterr().out
    assert snapshot(outside) | snapshot(elsewhere) == before


def test_temp_names_are_matched_exactly(tmp_path):
    """Only names write_block_atomic writes are cleaned; stale ones in the identity
    directory itself too (an interrupted identity.json write, a probe file)."""
    tier = DiskTier(tmp_path / "cache", 10 * FILE, ID)
    tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    sub = os.path.dirname(block_path(tier.base, key_of(0)))
    ours = [os.path.join(sub, f".{key_of(0)}.kvb.123.0badcafe.tmp"),
            os.path.join(tier.base, ".identity.json.123.0badcafe.tmp"),
            os.path.join(tier.base, ".probe.123.0badcafe.tmp")]
    foreign = [os.path.join(sub, ".notes.tmp"), os.path.join(sub, "draft.tmp"),
               os.path.join(tier.base, ".editor-swap.tmp")]
    old = time.time() - 10 * 3600
    for path in ours + foreign:
        with open(path, "wb") as f:
            f.write(b"x")
        os.utime(path, (old, old))
    DiskTier(tmp_path / "cache", 10 * FILE, ID, stale_tmp_age_s=60)
    assert not any(os.path.exists(p) for p in ours)
    assert all(os.path.exists(p) for p in foreign)


@pytest.mark.parametrize("read", ["get", "get_into", "get_record"])
def test_header_claiming_a_huge_payload_is_a_miss_before_any_allocation(tmp_path, read):
    """A sparse 64 GiB file with a sound header: no MemoryError, no 64 GiB read."""
    tier = DiskTier(tmp_path / "cache", 10**9, ID, payload_sizes=(BLOCK,))
    path = block_path(tier.base, key_of(0))
    os.makedirs(os.path.dirname(path))
    huge = 64 << 30
    header = encode_header(ID.digest(), key_of(0), 16, memoryview(b""))
    header = header[:88] + huge.to_bytes(8, "little") + header[96:]
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(HEADER_LEN + huge)
    start = time.monotonic()
    if read == "get_into":
        assert tier.get_into(key_of(0), np.empty(BLOCK, dtype=np.uint8)) is None
    else:
        assert getattr(tier, read)(key_of(0)) is None
    assert time.monotonic() - start < 5
    assert not os.path.exists(path) and tier.stats()["corrupt"] == 1


def test_payload_of_another_size_than_the_identitys_blocks(tmp_path):
    """Blocks of two sizes (a hybrid model's ordinary and checkpoint copies): both are
    stored and read; a third size is refused on put and a miss (deleted) on read."""
    tier = DiskTier(tmp_path / "cache", 10**9, ID, payload_sizes=(BLOCK, BLOCK // 4))
    with pytest.raises(ValueError, match="4096"):
        tier.put(key_of(0), b"x" * (BLOCK + 1), 16)
    assert tier.put(key_of(1), b"s" * (BLOCK // 4), 16) and tier.put(key_of(2), b"w" * BLOCK, 16)
    assert tier.get(key_of(1)) == b"s" * (BLOCK // 4) and tier.get(key_of(2)) == b"w" * BLOCK
    path = block_path(tier.base, key_of(0))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(block_bytes(key_of(0), b"y" * (BLOCK // 2)))  # valid, but not a block of ours
    assert tier.get(key_of(0)) is None and not os.path.exists(path)
    with pytest.raises(ValueError, match="payload_sizes"):
        DiskTier(tmp_path / "cache", 10**9, ID, payload_sizes=(BLOCK, 0))
