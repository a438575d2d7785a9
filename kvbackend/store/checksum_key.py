"""The optional key of a disk tier's checksums (BLAKE3 keyed mode): its sources and its id.

For a cache directory shared across a trust boundary: a writer without the key
cannot make a block that verifies. The key is 32 bytes, read from

* a key file (``disk_cache_key_file``): 32 raw bytes, or 64 hex digits and an
  optional newline; a regular file (a symlink to one is fine, as Kubernetes
  mounts secrets) owned by this user or root, neither readable nor writable by
  group or others (mode 0600 or 0400);
* else the environment variable ``KVBACKEND_DISK_KEY``: 64 hex digits.

Every problem is a ``ValueError`` that names the source. ``key_id`` names a key
without revealing it (a keyed hash of a constant): it is part of the tier's
identity, so processes with different keys, or none, use different identity
directories and never read, nor delete, each other's blocks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import replace

from blake3 import blake3

from kvbackend.store.identity import CacheIdentity

KEY_ENV = "KVBACKEND_DISK_KEY"
KEY_LEN = 32
_MAX_FILE_BYTES = 256


def check_checksum_key(key: object) -> bytes:
    """``key`` if it is 32 bytes, else a ``ValueError``."""
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"a checksum key must be {KEY_LEN} bytes, got {got}")
    return key


def key_id(key: bytes) -> str:
    """32 hex digits naming ``key``; reveals nothing about it. O(1)."""
    named = blake3(b"kvbackend disk checksum key id v1", key=check_checksum_key(key))
    return named.hexdigest()[:32]


def keyed_identity(identity: CacheIdentity, key: bytes | None) -> CacheIdentity:
    """``identity`` with the key's id among its extra fields (unchanged without a key),
    so tiers under different keys, or none, never share a block name. O(1)."""
    if key is None:
        return identity
    return replace(identity, extra=(*identity.extra, ("checksum_key_id", key_id(key))))


def load_checksum_key(key_file: str | None,
                      env: Mapping[str, str] = os.environ) -> bytes | None:
    """The key from ``key_file`` if given, else from ``$KVBACKEND_DISK_KEY``, else None."""
    if key_file is not None:
        return _parse(read_private_file(key_file), f"key file {key_file}")
    if KEY_ENV in env:
        text = env[KEY_ENV].strip()
        if len(text) != 2 * KEY_LEN or text.strip("0123456789abcdefABCDEF"):
            raise ValueError(f"{KEY_ENV} must hold {2 * KEY_LEN} hex digits "
                             f"(a {KEY_LEN}-byte key), got {len(text)} characters")
        return bytes.fromhex(text)
    return None


def read_private_file(path: str, what: str = "key file") -> bytes:
    """The first bytes of a secret ``what`` at ``path``: a regular file (or a symlink to
    one) owned by this user or root, mode 0600 or 0400; ``ValueError`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ValueError(f"{what} {path} has mode {mode:04o}: it must not be readable "
                             f"or writable by group or others (chmod 600)")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"{what} {path} is owned by uid {st.st_uid}, not by this "
                             f"process (uid {os.geteuid()}) nor root")
        return os.read(fd, _MAX_FILE_BYTES)
    finally:
        os.close(fd)


def _parse(data: bytes, source: str) -> bytes:
    if len(data) == KEY_LEN:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_LEN and not text.strip(b"0123456789abcdefABCDEF"):
        return bytes.fromhex(text.decode())
    raise ValueError(f"{source} must hold {KEY_LEN} bytes (raw, or as {2 * KEY_LEN} hex "
                     f"digits), got {len(data)} bytes")
