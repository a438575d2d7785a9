"""Names in a disk-tier cache directory (format v2), recognised without opening a file.

    <dir>/v2/<identity digest>/identity.json                 the identity's fields (for the CLI)
    <dir>/v2/<identity digest>/bounds/<bytes>.<pid>.<8 hex>  a live writer's size bound
    <dir>/v2/<identity digest>/<key[:2]>/<key>.kvb           one block
    .<final name>.<pid>.<8 hex>.tmp                          a write in progress, next to its
                                                             final name (a block, identity.json,
                                                             or a probe of writability)

Anything else under ``<dir>`` is not the cache's and is never read, scanned or removed.
"""

from __future__ import annotations

import os
import re
import secrets

from kvbackend.store.block_file import FORMAT_VERSION

FORMAT_DIR = f"v{FORMAT_VERSION}"
IDENTITY_FILE = "identity.json"
BOUNDS_DIR = "bounds"
PROBE_NAME = "probe"
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"

_HEX = frozenset("0123456789abcdef")
_BLOCK = re.compile(r"[0-9a-f]{64}\.kvb")
_TEMP = re.compile(r"\.([0-9a-f]{64}\.kvb|identity\.json|probe)\.[0-9]{1,10}\.[0-9a-f]{8}\.tmp")


def is_hex(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= _HEX


def is_identity_dir_name(name: str) -> bool:
    return is_hex(name, 64)


def is_subdir_name(name: str) -> bool:
    return is_hex(name, 2)


def is_block_name(name: str) -> bool:
    return _BLOCK.fullmatch(name) is not None


def temp_name(final_name: str) -> str:
    """A fresh temp name for a write of ``final_name`` by this process."""
    return f".{final_name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Exactly the names ``temp_name`` makes (never, say, an editor's ``.notes.tmp``)."""
    return name.startswith(".") and _TEMP.fullmatch(name) is not None


def block_name(key: str) -> str:
    return key + SUFFIX


def block_path(base: str, key: str) -> str:
    """``<base>/<key[:2]>/<key>.kvb``, where ``base`` is ``<dir>/v2/<identity digest>``."""
    return os.path.join(base, key[:2], block_name(key))
