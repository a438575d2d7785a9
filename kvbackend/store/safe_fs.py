"""The disk tier's filesystem boundary: which directories it trusts, the modes it
creates, and opens that never follow a link nor block on a special file.

A cache directory holds other tenants' prompts in recoverable form (layer-0 KV
depends only on token and position), so:

* Trust (``DirPolicy.check``, on the cache root, ``v2`` and the identity
  directory, whichever exist, for readers and writers alike). Private (the
  default): owned by this process's effective uid or by root, writable by
  neither group nor others. Group-shared (``shared_group``): any owner; writable
  by the group only if this process is in that group; never writable by others.
  ``v2`` and the identity directory must not be symlinks (the root may be).
* Modes: directories 0700 and files 0600 (shared: 2770, the setgid bit passing
  the group on, and 0660), set with ``fchmod`` after creation, whatever the umask.
* Below the identity directory nothing is followed: directories are opened with
  ``O_NOFOLLOW | O_DIRECTORY``, files with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
  cannot block the open) and used only if ``fstat`` says regular; files are
  created, renamed and unlinked relative to their directory's descriptor.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvbackend.store.layout import temp_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeCacheDirectory(ValueError):
    """A cache directory that other users could write to: refused at open."""


class NotRegularFile(OSError):
    """A FIFO, socket, device or directory where a file was expected."""


@dataclass(frozen=True)
class DirPolicy:
    """Who may share a cache directory (see the module docstring). O(1) per check."""

    shared_group: bool = False

    @property
    def dir_mode(self) -> int:
        return 0o2770 if self.shared_group else 0o700

    @property
    def file_mode(self) -> int:
        return 0o660 if self.shared_group else 0o600

    def check(self, path: str, *, allow_link: bool) -> None:
        """Raise ``UnsafeCacheDirectory`` unless the directory at ``path`` (if any) is
        trusted; a missing path, or one that is not a directory, passes (opening fails)."""
        try:
            st = os.stat(path) if allow_link else os.lstat(path)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeCacheDirectory(f"kvbackend disk tier: refusing {path}: a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            return
        mode = stat.S_IMODE(st.st_mode)
        where = f"kvbackend disk tier: refusing {path}"
        if mode & stat.S_IWOTH:
            raise UnsafeCacheDirectory(f"{where}: writable by others (mode {mode:04o})")
        if self.shared_group:
            if mode & stat.S_IWGRP and st.st_gid not in _own_groups():
                raise UnsafeCacheDirectory(f"{where}: writable by group {st.st_gid}, which this "
                                           f"process is not in")
            return
        if st.st_uid not in (os.geteuid(), 0):
            raise UnsafeCacheDirectory(f"{where}: owned by uid {st.st_uid}, not by this "
                                       f"process (uid {os.geteuid()}) nor root")
        if mode & stat.S_IWGRP:
            raise UnsafeCacheDirectory(f"{where}: writable by its group (mode {mode:04o}); set "
                                       f"disk_cache_shared_group to share it within a group")

    def tighten(self, path: str) -> None:
        """Drop permission bits beyond the policy's from a directory this user owns
        (trees left by older versions were 0755). Never widens."""
        fd = open_dir(path)
        try:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid == os.geteuid() and mode & ~self.dir_mode:
                os.fchmod(fd, mode & self.dir_mode)
        finally:
            os.close(fd)


def _own_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def open_dir(path: str, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path``; ELOOP if it is a symlink, ENOTDIR if
    it is not a directory."""
    return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)


@contextmanager
def opened_dir(path: str) -> Iterator[int]:
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(path: str, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a final symlink (ELOOP) and
    without blocking on a FIFO; ``NotRegularFile`` for anything but a regular file."""
    fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    return fd, st


def is_junk_error(e: OSError) -> bool:
    """Whether an open failed because a symlink or a non-directory sits in the way."""
    return isinstance(e, NotRegularFile) or e.errno in (errno.ELOOP, errno.ENOTDIR)


def make_dirs(path: str, policy: DirPolicy, *, durable: bool) -> None:
    """Create ``path`` and its missing parents with the policy's mode; each new
    directory is fsynced into its parent (if ``durable``). Races with other creators
    are fine. O(depth)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o700)
        except FileExistsError:
            continue
        with opened_dir(new) as fd:
            os.fchmod(fd, policy.dir_mode)
        if durable:
            fsync_dir(os.path.dirname(new) or ".")


def fsync_dir(path: str) -> None:
    try:
        with opened_dir(path) as fd:
            os.fsync(fd)
    except OSError:
        pass  # the entry exists; only its durability across a power cut is at stake


def write_atomic(dir_fd: int, name: str, chunks: Sequence[bytes | memoryview], *,
                 mode: int, durable: bool) -> None:
    """Write ``chunks`` as file ``name`` in the directory ``dir_fd`` so that readers see
    all of it or nothing: a fresh temp file (``layout.temp_name``) created with
    ``mode``, fsync, rename over ``name``, fsync of the directory (the two fsyncs
    only if ``durable``). On any error the temp file is removed and the error raised."""
    tmp = temp_name(name)
    fd = os.open(tmp, _CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if durable:
        try:
            os.fsync(dir_fd)
        except OSError:
            pass


def unlink_in(dir_path: str, name: str) -> bool:
    """Remove the entry ``name`` of the directory ``dir_path``, which must not be a
    symlink (so nothing outside it is touched); False if that fails. O(1)."""
    try:
        with opened_dir(dir_path) as fd:
            os.unlink(name, dir_fd=fd)
        return True
    except OSError:
        return False
