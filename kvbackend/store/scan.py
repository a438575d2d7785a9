"""Walk a cache directory (format v2) without a tier: for the CLI and tools.

Only names that the format defines are reported (``v2/<64 hex>/<2 hex>/<key>.kvb``
and ``.tmp`` files); anything else under the directory, a ``v1`` tree of an
older format included, is left alone.
All functions tolerate files vanishing while they run. O(#files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from kvbackend.store.block_file import SUFFIX, TMP_SUFFIX
from kvbackend.store.disk_tier import FORMAT_DIR, IDENTITY_FILE

_HEX = frozenset("0123456789abcdef")


def _is_hex(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= _HEX


@dataclass(frozen=True)
class IdentityDir:
    digest: str
    path: str
    identity: dict | None  # contents of identity.json, None if missing or unreadable

    @property
    def model_fingerprint(self) -> str | None:
        return None if self.identity is None else self.identity.get("model_fingerprint")

    def matches(self, prefix: str) -> bool:
        """True if the identity digest or the model fingerprint starts with ``prefix``."""
        prefix = prefix.lower()
        return self.digest.startswith(prefix) or (self.model_fingerprint or "").startswith(prefix)


@dataclass(frozen=True)
class FileEntry:
    path: str
    name: str
    size: int
    is_temp: bool

    @property
    def key(self) -> str:
        return self.name[: -len(SUFFIX)]


def identity_dirs(root: str | os.PathLike) -> list[IdentityDir]:
    """The identity directories under ``root/v2``, sorted by digest."""
    base = os.path.join(os.fspath(root), FORMAT_DIR)
    try:
        names = sorted(e.name for e in os.scandir(base) if _is_hex(e.name, 64) and e.is_dir())
    except OSError:
        return []
    result = []
    for name in names:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, IDENTITY_FILE)) as f:
                identity = json.load(f)
            if not isinstance(identity, dict):
                identity = None
        except (OSError, ValueError):
            identity = None
        result.append(IdentityDir(name, path, identity))
    return result


def block_files(identity_dir: IdentityDir) -> Iterator[FileEntry]:
    """Block files (``is_temp`` False) and temp files (True) of one identity."""
    try:
        subdirs = sorted(e.path for e in os.scandir(identity_dir.path)
                         if _is_hex(e.name, 2) and e.is_dir())
    except OSError:
        return
    for sub in subdirs:
        try:
            entries = sorted(os.scandir(sub), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            is_block = e.name.endswith(SUFFIX) and _is_hex(e.name[: -len(SUFFIX)], 64)
            is_temp = e.name.startswith(".") and e.name.endswith(TMP_SUFFIX)
            if not (is_block or is_temp):
                continue
            try:
                size = e.stat().st_size
            except OSError:
                continue
            yield FileEntry(e.path, e.name, size, is_temp)
