"""Who may read and write a disk-tier directory: modes, ownership, keyed checksums.

The tests run as root, which bypasses permission checks, so what they check is
what kvbackend itself enforces: the modes it creates, the directories it refuses
to trust, and that a block planted without the checksum key never verifies.
"""

import os
import stat

import pytest

from kvbackend.cli import main
from kvbackend.store.block_file import HEADER_LEN, encode_header
from kvbackend.store.layout import block_path
from kvbackend.store.checksum_key import KEY_ENV, load_checksum_key
from kvbackend.store.disk_tier import DiskTier
from kvbackend.store.safe_fs import UnsafeCacheDirectory
from tests.store_helpers import key_of, make_identity, payload_for, tree_files

ID = make_identity()
BLOCK = 1024
KEY = bytes(range(32))
OTHER_UID = 4242


@pytest.fixture
def umask():
    """Run with the given umask, restoring the process's own afterwards."""
    saved = os.umask(0)
    yield os.umask
    os.umask(saved)


def modes(root) -> dict[str, int]:
    """Permission bits of every directory and file under ``root`` (not following links)."""
    found = {}
    for d, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(d, name)
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


# ------------------------------------------------------------------ modes
@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_private_directory_modes_do_not_depend_on_the_umask(tmp_path, umask, mask):
    umask(mask)
    tier = DiskTier(tmp_path / "cache", 10**7, ID)
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    found = modes(tmp_path / "cache")
    assert found and all(mode == (0o700 if os.path.isdir(tmp_path / "cache" / rel) else 0o600)
                         for rel, mode in found.items()), found
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700


@pytest.mark.parametrize("mask", [0o000, 0o077])
def test_group_shared_directory_modes(tmp_path, umask, mask):
    umask(mask)
    tier = DiskTier(tmp_path / "cache", 10**7, ID, shared_group=True)
    assert tier.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    found = modes(tmp_path / "cache")
    dirs = {m for rel, m in found.items() if os.path.isdir(tmp_path / "cache" / rel)}
    files = {m for rel, m in found.items() if not os.path.isdir(tmp_path / "cache" / rel)}
    assert dirs == {0o2770} and files == {0o660}, found


def test_a_tree_left_readable_by_an_older_version_is_tightened(tmp_path):
    root = tmp_path / "cache"
    DiskTier(root, 10**7, ID).put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    for d, _, _ in os.walk(root):
        os.chmod(d, 0o755)
    DiskTier(root, 10**7, ID)
    assert stat.S_IMODE(os.stat(root / "v2").st_mode) == 0o700


# ------------------------------------------------------------------ trust
@pytest.mark.parametrize("level", ["root", "format", "identity"])
def test_directory_owned_by_another_user_is_refused(tmp_path, level):
    root = tmp_path / "cache"
    tier = DiskTier(root, 10**7, ID)
    path = {"root": root, "format": root / "v2", "identity": tier.base}[level]
    os.chown(path, OTHER_UID, -1)
    for read_only in (False, True):
        with pytest.raises(UnsafeCacheDirectory, match=f"owned by uid {OTHER_UID}"):
            DiskTier(root, 10**7, ID, read_only=read_only)


def test_group_or_world_writable_directory_is_refused_unless_shared(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o770)
    with pytest.raises(UnsafeCacheDirectory, match="writable by its group.*shared_group"):
        DiskTier(root, 10**7, ID)
    os.chown(root, -1, os.getegid())
    tier = DiskTier(root, 10**7, ID, shared_group=True)
    assert tier.put(key_of(0), b"x" * BLOCK, 16)
    os.chown(root, -1, 4243)  # a group this process is not in
    with pytest.raises(UnsafeCacheDirectory, match="group 4243"):
        DiskTier(root, 10**7, ID, shared_group=True)
    os.chmod(root, 0o777)
    for shared in (False, True):
        with pytest.raises(UnsafeCacheDirectory, match="writable by others"):
            DiskTier(root, 10**7, ID, shared_group=shared)


def test_shared_directory_may_hold_group_members_files(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 10**7, ID, shared_group=True)
    assert tier.put(key_of(0), b"x" * BLOCK, 16)
    for path in [root / "v2", tier.base, *tree_files(tier.base, ".kvb")]:
        os.chown(path, OTHER_UID, -1)  # written by another member of the group
    again = DiskTier(root, 10**7, ID, shared_group=True)
    assert again.get(key_of(0)) == b"x" * BLOCK


# ------------------------------------------------------------------ keyed checksums
def planted(tier: DiskTier, key: str, payload: bytes, checksum_key: bytes | None) -> str:
    """Write a block file at ``key``'s path in ``tier`` as a writer holding ``checksum_key``."""
    path = block_path(tier.base, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = encode_header(tier.identity_digest, key, 16, memoryview(payload),
                           checksum_key=checksum_key)
    with open(path, "wb") as f:
        f.write(header + payload)
    return path


def test_keyed_round_trip_and_separate_trees(tmp_path):
    keyed = DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=KEY)
    plain = DiskTier(tmp_path / "cache", 10**7, ID)
    other = DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=bytes(32))
    assert len({keyed.base, plain.base, other.base}) == 3
    assert keyed.put(key_of(0), payload_for(key_of(0), BLOCK), 16)
    assert keyed.get(key_of(0)) == payload_for(key_of(0), BLOCK)
    assert plain.get(key_of(0)) is None and other.get(key_of(0)) is None
    assert DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=KEY).get(key_of(0)) is not None


@pytest.mark.parametrize("forger_key", [None, bytes(32)])
def test_a_writer_without_the_key_cannot_plant_a_block(tmp_path, forger_key):
    keyed = DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=KEY)
    path = planted(keyed, key_of(0), b"forged" * 100, forger_key)
    assert keyed.get(key_of(0)) is None and not os.path.exists(path)
    assert keyed.stats()["corrupt"] == 1


def test_an_unkeyed_reader_refuses_keyed_blocks(tmp_path):
    plain = DiskTier(tmp_path / "cache", 10**7, ID)
    path = planted(plain, key_of(0), b"keyed" * 100, KEY)
    assert plain.get(key_of(0)) is None and not os.path.exists(path)


def test_keyed_blocks_copied_across_keys_do_not_verify(tmp_path):
    a = DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=KEY)
    b = DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=bytes(32))
    a.put(key_of(0), b"a" * BLOCK, 16)
    dst = block_path(b.base, key_of(0))
    os.makedirs(os.path.dirname(dst))
    with open(block_path(a.base, key_of(0)), "rb") as src, open(dst, "wb") as out:
        out.write(src.read())
    assert b.get(key_of(0)) is None  # identity digest and MAC differ


# ------------------------------------------------------------------ key sources
def write_key_file(path, data: bytes, mode: int = 0o600) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return str(path)


def test_key_from_file_or_environment(tmp_path):
    raw = write_key_file(tmp_path / "raw.key", KEY)
    text = write_key_file(tmp_path / "hex.key", KEY.hex().encode() + b"\n", 0o400)
    assert load_checksum_key(raw, env={}) == KEY == load_checksum_key(text, env={})
    assert load_checksum_key(None, env={KEY_ENV: KEY.hex()}) == KEY
    assert load_checksum_key(raw, env={KEY_ENV: "00" * 32}) == KEY  # the file wins
    assert load_checksum_key(None, env={}) is None


@pytest.mark.parametrize("problem, match", [
    ("group-readable", "mode 0640"), ("short", "32 bytes"), ("missing", "cannot read"),
    ("not-hex", "32 bytes"), ("directory", "not a regular file"),
])
def test_bad_key_file_is_a_clear_error(tmp_path, problem, match):
    path = tmp_path / "k"
    if problem == "group-readable":
        write_key_file(path, KEY, 0o640)
    elif problem == "short":
        write_key_file(path, KEY[:16])
    elif problem == "not-hex":
        write_key_file(path, b"z" * 64)
    elif problem == "directory":
        path.mkdir()
    with pytest.raises(ValueError, match=match):
        load_checksum_key(str(path), env={})


@pytest.mark.parametrize("value", ["", "abc", "zz" * 32, "00" * 31])
def test_bad_key_in_environment_is_a_clear_error(value):
    with pytest.raises(ValueError, match=KEY_ENV):
        load_checksum_key(None, env={KEY_ENV: value})


def test_key_of_the_wrong_length_is_refused_by_the_tier(tmp_path):
    with pytest.raises(ValueError, match="32 bytes"):
        DiskTier(tmp_path / "cache", 10**7, ID, checksum_key=b"short")


# ------------------------------------------------------------------ the CLI and keys
def test_cli_verify_skips_keyed_trees_without_the_key(tmp_path, capsys, monkeypatch):
    root = tmp_path / "cache"
    keyed = DiskTier(root, 10**7, ID, checksum_key=KEY)
    keyed.put(key_of(0), b"k" * BLOCK, 16)
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert main(["cache", "verify", str(root), "--no-progress", "--delete"]) == 0
    assert "1 skipped (keyed" in capsys.readouterr().out
    assert keyed.get(key_of(0)) == b"k" * BLOCK  # not deleted
    monkeypatch.setenv(KEY_ENV, KEY.hex())
    assert main(["cache", "verify", str(root), "--no-progress"]) == 0
    assert "1 ok, 0 bad" in capsys.readouterr().out
    path = block_path(keyed.base, key_of(0))
    with open(path, "r+b") as f:
        f.seek(HEADER_LEN + 5)
        f.write(b"!")
    assert main(["cache", "verify", str(root), "--no-progress"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
