"""Walk a cache directory (format v2) without following links: for the tier's rescans
and for the CLI.

Only names that the layout defines are reported (:mod:`kvbackend.store.layout`:
``v2/<64 hex>/<2 hex>/<key>.kvb`` and exact temp names, in the key
subdirectories and in the identity directory itself), and only regular files
and real directories: a symlink, FIFO or anything else under the directory, a
``v1`` tree of an older format included, is neither reported nor entered.
All functions tolerate files vanishing while they run. O(#files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvbackend.store.block_file import BlockHeader, verify_stream
from kvbackend.store.layout import (
    FORMAT_DIR, IDENTITY_FILE, SUFFIX, is_block_name, is_identity_dir_name, is_subdir_name,
    is_temp_name,
)
from kvbackend.store.safe_fs import open_dir, open_regular, unlink_in

_IDENTITY_JSON_MAX = 1 << 20


@dataclass(frozen=True)
class IdentityDir:
    digest: str
    path: str
    identity: dict | None  # contents of identity.json, None if missing or unreadable

    @property
    def model_fingerprint(self) -> str | None:
        return None if self.identity is None else self.identity.get("model_fingerprint")

    @property
    def checksum_key_id(self) -> str | None:
        """The id of the checksum key its blocks are keyed with, None if unkeyed."""
        extra = dict(map(tuple, (self.identity or {}).get("extra", [])))
        return extra.get("checksum_key_id")

    def matches(self, prefix: str) -> bool:
        """True if the identity digest or the model fingerprint starts with ``prefix``."""
        prefix = prefix.lower()
        return self.digest.startswith(prefix) or (self.model_fingerprint or "").startswith(prefix)


class FileEntry(NamedTuple):
    """One regular file (a named tuple: a rescan makes millions)."""

    directory: str  # the key subdirectory, or the identity directory for its own temp files
    name: str
    size: int
    mtime_ns: int
    is_temp: bool

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @property
    def key(self) -> str:
        return self.name[: -len(SUFFIX)]

    def remove(self) -> bool:
        """Unlink this entry without following a link (False if that fails)."""
        return unlink_in(self.directory, self.name)


def identity_dirs(root: str | os.PathLike) -> list[IdentityDir]:
    """The identity directories under ``root/v2``, sorted by digest."""
    base = os.path.join(os.fspath(root), FORMAT_DIR)
    try:
        fd = open_dir(base)
    except OSError:
        return []
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries
                           if is_identity_dir_name(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        names = []
    finally:
        os.close(fd)
    return [IdentityDir(n, os.path.join(base, n), _read_identity(os.path.join(base, n)))
            for n in names]


def _read_identity(path: str) -> dict | None:
    try:
        fd, _ = open_regular(os.path.join(path, IDENTITY_FILE))
        with open(fd, "rb") as f:
            identity = json.loads(f.read(_IDENTITY_JSON_MAX))
        return identity if isinstance(identity, dict) else None
    except (OSError, ValueError):
        return None


def block_files(identity_dir: str) -> Iterator[FileEntry]:
    """Block files (``is_temp`` False) and temp files (True) of one identity directory,
    in no particular order."""
    subdirs = []
    for entry in _regular_and_dirs(identity_dir):
        if isinstance(entry, str):
            if is_subdir_name(entry):
                subdirs.append(entry)
        elif entry.is_temp:
            yield entry
    for sub in subdirs:
        for entry in _regular_and_dirs(os.path.join(identity_dir, sub)):
            if isinstance(entry, FileEntry) and (entry.is_temp or is_block_name(entry.name)):
                yield entry


def _regular_and_dirs(directory: str) -> Iterator[FileEntry | str]:
    """Regular files of ``directory`` as entries (``is_temp`` set for temp names) and
    its real subdirectories as names; links and special files are skipped."""
    try:
        fd = open_dir(directory)
    except OSError:
        return
    try:
        with os.scandir(fd) as entries:
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        yield e.name
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        yield FileEntry(directory, e.name, st.st_size, st.st_mtime_ns,
                                        is_temp_name(e.name))
                except OSError:
                    continue  # removed meanwhile
    except OSError:
        return
    finally:
        os.close(fd)


def verify_file(path: str, identity_digest: str | None = None, key: str | None = None, *,
                checksum_key: bytes | None = None) -> BlockHeader:
    """Check the block file at ``path`` (not following a final link; not opening a
    FIFO) in O(1) memory; raises ``CorruptBlock`` or ``OSError``."""
    fd, st = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        return verify_stream(f, st.st_size, identity_digest, key, checksum_key=checksum_key)
