"""The size bound of an identity directory that several processes write.

Each writable tier declares its bound as an empty file
``<identity dir>/bounds/<max_bytes>.<pid>.<8 hex>`` and renews the file's mtime
at every rescan (a heartbeat). The directory's bound is the largest bound that
a live writer declared, live meaning renewed within ``ttl_s`` seconds. So a
process opened with a smaller bound never trims the directory below what a
live, more generous writer relies on; once those are gone (a clean exit
withdraws the declaration, a crashed writer's expires after ``ttl_s``), the
smaller bound applies. Whoever sees an expired declaration removes it.
Declarations are per identity directory, hence per TP rank.
"""

from __future__ import annotations

import os
import re
import secrets
import time

from kvbackend.store.layout import BOUNDS_DIR
from kvbackend.store.safe_fs import DirPolicy, make_dirs, opened_dir

_NAME = re.compile(r"([0-9]{1,20})\.[0-9]{1,10}\.[0-9a-f]{8}")


def is_declaration_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


class BoundDeclaration:
    """This writer's declaration in one identity directory. Never raises for
    environment errors (a declaration that cannot be written only weakens the
    guarantee for others). ``effective()`` is O(#declarations)."""

    def __init__(self, base: str, max_bytes: int, *, ttl_s: float, policy: DirPolicy) -> None:
        self.directory = os.path.join(base, BOUNDS_DIR)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.policy = policy
        self.name = f"{max_bytes}.{os.getpid()}.{secrets.token_hex(4)}"
        self.heartbeat()

    def heartbeat(self) -> None:
        """Renew this declaration (creating it, and its directory, if missing)."""
        try:
            make_dirs(self.directory, self.policy, durable=False)
            with opened_dir(self.directory) as fd:
                try:
                    os.utime(self.name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    created = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                                      | os.O_CLOEXEC, self.policy.file_mode, dir_fd=fd)
                    os.fchmod(created, self.policy.file_mode)
                    os.close(created)
        except OSError:
            pass

    def effective(self) -> int:
        """The largest bound of a live declaration, this one's included; removes
        expired ones."""
        bound = self.max_bytes
        now = time.time()
        try:
            with opened_dir(self.directory) as fd, os.scandir(fd) as entries:
                for entry in entries:
                    match = _NAME.fullmatch(entry.name)
                    if match is None or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        age = now - entry.stat(follow_symlinks=False).st_mtime
                        if age > self.ttl_s:
                            os.unlink(entry.name, dir_fd=fd)
                        else:
                            bound = max(bound, int(match.group(1)))
                    except OSError:
                        continue  # withdrawn meanwhile
        except OSError:
            pass
        return bound

    def withdraw(self) -> None:
        try:
            with opened_dir(self.directory) as fd:
                os.unlink(self.name, dir_fd=fd)
        except OSError:
            pass
