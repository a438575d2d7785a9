"""Persistent local-disk tier: one checksummed file per KV block, LRU-bounded by bytes.

On-disk format, version 2
=========================

Directory layout: one file per block, ``<dir>/v2/<identity digest>/<key[:2]>/<key>.kvb``,
beside ``identity.json``, the live writers' ``bounds/`` and temp files; every name is
defined and recognised in :mod:`kvbackend.store.layout` (``dir`` may be shared by
several processes and identities).

``<identity digest>`` is ``CacheIdentity.digest()`` (model weights fingerprint,
kv dtype, block size, layout, TP rank/size, format version, and the checksum
key's id for a keyed tier), so blocks of different models, dtypes, TP shards or
keys can never be confused, even by path. The ``v2`` level keeps formats apart:
a ``v1`` tree (format 1, sha256 checksums) left next to it is never read,
scanned or removed (``rm -r`` it).

Block file = 128-byte header + payload: the byte layout, its checksum and the
reasons behind them are in :mod:`kvbackend.store.block_file`, which implements it.

Guarantees
==========
* Atomic writes: temp file in the same directory, fsync, ``os.replace``, fsync
  of the directory; a directory created on first use is fsynced into its parent.
  A crash leaves at worst a temp file, which is never read (stale ones, older
  than ``stale_tmp_age_s``, are removed by rescans, in the identity directory
  itself too; only names of the exact temp pattern are).
* Verified reads: magic, version, header length, flags, identity, key, payload
  length (one of ``payload_sizes``, checked before anything is allocated) and
  checksum; any mismatch is a miss, and the file is deleted (only if the name
  still holds the inode that was read, so a fresh rewrite by another process
  survives). One warning per kind of problem; never raises.
* Security boundary (:mod:`kvbackend.store.safe_fs`): directories 0700 and files
  0600 whatever the umask (``shared_group``: 2770 and 0660); a root, ``v2`` or
  identity directory owned by another user or writable by group or others
  (group: unless ``shared_group``) is refused with ``UnsafeCacheDirectory``;
  below the identity directory no symlink is followed and only regular files are
  opened (a FIFO never blocks a reader), by reads, writes, rescans and eviction.
  ``contains`` is a single ``lstat`` and may report a block that ``get`` refuses.
* No shared index: each process keeps an in-memory LRU index (initial order
  from file mtimes; hits touch the file's mtime so other processes see them).
  Rescans rebuild it from the directory, off the caller's path, on a background
  thread every ``rescan_interval_s`` seconds, or 10x a rescan's duration if
  longer (None: only when ``rescan`` is called); 1M files take ~20 s and ~190 MB
  of index on the dev box (``benchmarks/bench_disk_index.py``). A file that
  vanishes (another process evicted it) is a miss. A ``probe_only`` tier (for a
  scheduler that only asks whether a block exists) keeps no index at all:
  ``contains`` is one ``lstat``.
* The bound: ``max_bytes`` bounds the identity directory. Several writers
  declare theirs (:mod:`kvbackend.store.disk_bound`) and each evicts down to
  the largest bound of a live writer, so a process opened with a smaller bound
  never wipes what others rely on. Exact within one process; with several
  writers it is approximate between rescans.
* Environment failures never raise, nor make the tier read-only: a failed write
  backs off (``backoff_s``, doubling up to ``max_backoff_s``; a full filesystem
  for the whole tier, other errors for the one key subdirectory) and is retried
  after; a full filesystem also evicts this tier's least recently used blocks,
  worth the failed write, so a tier that filled the disk drains it. Only opening
  an unwritable directory serves it read-only ("ro"); one that cannot be
  created disables the tier ("disabled"). Reads are served in every mode but
  "disabled".
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from kvbackend.store.backoff import Backoff
from kvbackend.store.block_file import (
    HEADER_LEN, MAX_NUM_TOKENS, BlockRecord, CorruptBlock, as_byte_view, encode_header,
    read_block, read_block_into,
)
from kvbackend.store.checksum_key import keyed_identity
from kvbackend.store.disk_bound import BoundDeclaration
from kvbackend.store.disk_index import DiskIndex
from kvbackend.store.identity import CacheIdentity
from kvbackend.store.layout import (
    FORMAT_DIR, IDENTITY_FILE, PROBE_NAME, block_name, block_path, temp_name,
)
from kvbackend.store.safe_fs import (
    DirPolicy, is_junk_error, make_dirs, open_dir, open_regular, opened_dir, write_atomic,
)
from kvbackend.store.scan import block_files
from kvbackend.store.tier import Payload, check_key, check_payload_sizes

logger = logging.getLogger("kvbackend.store")

__all__ = ["FORMAT_DIR", "IDENTITY_FILE", "DiskMode", "DiskTier"]

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_WHOLE_TIER = "*"  # the backoff scope of a full filesystem
_RESCAN_DUTY = 10  # background rescans wait at least this many times their own duration
_T = TypeVar("_T")


class DiskMode(StrEnum):
    """What a disk tier does: read and write, only read, or nothing (misses everything).
    A ``StrEnum``: equal to its value, and its value in ``stats()``."""

    RW = "rw"
    RO = "ro"
    DISABLED = "disabled"


class DiskTier:
    """LRU-bounded, checksummed block files under ``<directory>/v2/<identity digest>``.

    ``mode`` (a ``DiskMode``) is RW, RO (serves reads, refuses puts) or DISABLED
    (misses everything). ``payload_sizes``: the sizes a block's payload of this
    identity may have (puts of another size raise; files announcing another are
    misses, before any allocation when larger than all); without them a payload
    may be as large as the bound.
    Complexity: ``put``/``get``/``get_into`` O(payload) I/O plus O(1) index work;
    ``contains`` one ``lstat``; eviction O(#evicted) unlinks; a rescan
    O(#files of this identity), never on the caller's thread unless called.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        identity: CacheIdentity,
        *,
        read_only: bool = False,
        durable: bool = True,
        stale_tmp_age_s: float = 3600.0,
        rescan_interval_s: float | None = 60.0,
        probe_only: bool = False,
        payload_sizes: Collection[int] | None = None,
        checksum_key: bytes | None = None,
        shared_group: bool = False,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        bound_ttl_s: float = 600.0,
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        payload_sizes = check_payload_sizes(payload_sizes)
        identity = keyed_identity(identity, checksum_key)
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.identity = identity
        self.identity_digest = identity.digest()
        self.base = os.path.join(os.fspath(self.directory), FORMAT_DIR, self.identity_digest)
        self.durable = durable
        self.stale_tmp_age_s = stale_tmp_age_s
        self.rescan_interval_s = rescan_interval_s
        self.probe_only = probe_only
        self.payload_sizes = payload_sizes
        self.checksum_key = checksum_key
        self.policy = DirPolicy(shared_group)
        self.max_payload = max(payload_sizes) if payload_sizes else max_bytes - HEADER_LEN
        self._index = None if probe_only else DiskIndex()
        self._backoff = Backoff(backoff_s, max_backoff_s)
        self._lock = threading.Lock()  # counters and warnings
        self._rescan_lock = threading.Lock()
        self._warned: set[str] = set()
        self._counters = dict(hits=0, misses=0, puts=0, put_failures=0, rejected=0,
                              evictions=0, corrupt=0)
        for level, allow_link in ((self.directory, True), (self.base, False),
                                  (os.path.dirname(self.base), False)):
            self.policy.check(os.fspath(level), allow_link=allow_link)
        self.mode = DiskMode.RO if read_only or probe_only else self._open_for_writing()
        self._bound = max_bytes
        self._declaration = None
        if self.mode is DiskMode.RW:
            self._declaration = BoundDeclaration(self.base, max_bytes, ttl_s=bound_ttl_s,
                                                 policy=self.policy)
        if self.mode is not DiskMode.DISABLED and not probe_only:
            self.rescan()
        stop = threading.Event()
        if self.mode is DiskMode.RW and rescan_interval_s is not None:
            threading.Thread(target=_rescan_loop, args=(weakref.ref(self), stop,
                                                        rescan_interval_s),
                             name="kvbackend-disk-rescan", daemon=True).start()
        self._finalizer = weakref.finalize(self, _release, stop, self._declaration)

    # ----------------------------------------------------------------- set-up
    def _open_for_writing(self) -> DiskMode:
        try:
            make_dirs(self.base, self.policy, durable=self.durable)
            for level in (os.path.dirname(self.base), self.base):
                self.policy.tighten(level)
            with opened_dir(self.base) as fd:
                probe = temp_name(PROBE_NAME)
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 self.policy.file_mode, dir_fd=fd))
                os.unlink(probe, dir_fd=fd)
            self._write_identity_file()
            return DiskMode.RW
        except OSError as e:
            if e.errno in _FULL_ERRNOS and os.path.isdir(self.base):
                self._write_failed(e, _WHOLE_TIER, 0)
                return DiskMode.RW  # full now; retried after the backoff
            mode = DiskMode.RO if os.path.isdir(self.base) else DiskMode.DISABLED
            self._warn_once("open", "kvbackend disk tier: cannot write to %s (%s); tier is %s",
                            self.base, e, "read-only" if mode is DiskMode.RO else "disabled")
            return mode

    def _write_identity_file(self) -> None:
        """identity.json, unless present (written once per identity directory)."""
        with opened_dir(self.base) as fd:
            try:
                os.lstat(IDENTITY_FILE, dir_fd=fd)
                return
            except FileNotFoundError:
                pass
            data = json.dumps(dict(self.identity.to_dict(), digest=self.identity_digest),
                              indent=1, sort_keys=True).encode()
            write_atomic(fd, IDENTITY_FILE, [data], mode=self.policy.file_mode,
                         durable=self.durable)

    def close(self) -> None:
        """Stop background rescans and withdraw this writer's bound declaration (also
        done when the tier is garbage-collected or the interpreter exits)."""
        self._finalizer()

    def rescan(self) -> None:
        """Rebuild the index from the files on disk (LRU order by mtime), remove stale
        temp files, renew this writer's bound declaration and evict down to the
        directory's bound (if writable). O(#files); no-op for a probe-only tier."""
        if self._index is None or self.mode is DiskMode.DISABLED:
            return
        with self._rescan_lock:
            if self._declaration is not None:
                self._declaration.heartbeat()
                self._bound = self._declaration.effective()
            found: list[tuple[int, str, int]] = []
            stale_ns = time.time_ns() - int(self.stale_tmp_age_s * 1e9)
            self._index.begin_rebuild()
            try:
                for entry in block_files(self.base):
                    if not entry.is_temp:
                        found.append((entry.mtime_ns, entry.key, entry.size))
                    elif self.mode is DiskMode.RW and entry.mtime_ns < stale_ns:
                        entry.remove()
            finally:
                found.sort()
                self._index.end_rebuild((key, size) for _, key, size in found)
        self.evict_to(self._bound)  # others' writes may have pushed us over

    # ---------------------------------------------------------------- helpers
    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (logger.warning if first else logger.debug)(msg, *args)

    def _count(self, counter: str, n: int = 1) -> None:
        """Bump a stats counter; under the lock, as BlockMover's reader threads read."""
        with self._lock:
            self._counters[counter] += n

    def _path(self, key: str) -> str:
        return block_path(self.base, key)

    def _learn(self, key: str, size: int) -> None:
        if self._index is not None:
            self._index.touch(key, size)

    def _forget(self, key: str) -> None:
        if self._index is not None:
            self._index.drop(key)

    @contextmanager
    def _subdir(self, key: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of ``key``'s subdirectory, never through a symlink; with
        ``create`` it (and the identity directory, if cleared meanwhile) is made."""
        path = os.path.dirname(self._path(key))
        try:
            fd = open_dir(path)
        except FileNotFoundError:
            if not create:
                raise
            make_dirs(path, self.policy, durable=self.durable)
            self._write_identity_file()
            fd = open_dir(path)
        try:
            yield fd
        finally:
            os.close(fd)

    def _discard_bad(self, key: str, dir_fd: int, st: os.stat_result | None,
                     reason: str) -> None:
        """Count, forget and (if writable) delete a bad entry: the inode ``st`` that
        was read, or for ``st`` None whatever non-file, non-directory sits there."""
        self._count("corrupt")
        self._forget(key)
        self._warn_once("corrupt", "kvbackend disk tier: dropping bad block file %s: %s",
                        self._path(key), reason)
        if self.mode is not DiskMode.RW:
            return
        try:
            now = os.lstat(block_name(key), dir_fd=dir_fd)
            if (stat.S_ISDIR(now.st_mode) or (st is None and stat.S_ISREG(now.st_mode))
                    or (st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev))):
                return  # a directory, or a fresh block written meanwhile: not ours to drop
            os.unlink(block_name(key), dir_fd=dir_fd)
        except OSError:
            pass

    # -------------------------------------------------------------------- API
    def put(self, key: str, payload: Payload, num_tokens: int) -> bool:
        """Store a block; True if it is on disk afterwards (written now or before).

        False, with a warning once per cause, if the tier is not writable, is
        backing off after a failed write, or the block alone exceeds ``max_bytes``.
        """
        check_key(key)
        if not 0 <= num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"num_tokens must lie in [0, {MAX_NUM_TOKENS}], got {num_tokens}")
        view = as_byte_view(payload)
        if self.payload_sizes and view.nbytes not in self.payload_sizes:
            raise ValueError(f"a block of this tier holds {sorted(self.payload_sizes)} "
                             f"bytes, got {view.nbytes}")
        size = HEADER_LEN + view.nbytes
        subdir = key[:2]
        if (self.mode is not DiskMode.RW or size > self.max_bytes
                or self._backoff.blocked(_WHOLE_TIER, subdir)):
            self._count("rejected")
            return False
        try:
            with self._subdir(key, create=True) as fd:
                existing = _regular_file_size(block_name(key), fd)
                if existing is not None:
                    self._learn(key, existing)
                    return True
                self.evict_to(self._bound - size)
                header = encode_header(self.identity_digest, key, num_tokens, view,
                                       checksum_key=self.checksum_key)
                write_atomic(fd, block_name(key), [header, view], mode=self.policy.file_mode,
                             durable=self.durable)
        except OSError as e:
            self._count("put_failures")
            self._write_failed(e, subdir, size)
            return False
        self._backoff.succeeded(_WHOLE_TIER, subdir)
        self._learn(key, size)
        self._count("puts")
        return True

    def _write_failed(self, e: OSError, subdir: str, size: int) -> None:
        if e.errno in _FULL_ERRNOS:
            freed = self.evict_to(self.bytes_used - size) if size else 0
            delay = self._backoff.failed(_WHOLE_TIER)
            self._warn_once("full", "kvbackend disk tier: filesystem full writing a %d-byte "
                            "block to %s (%s); evicted %d of this tier's blocks, writes retried "
                            "after %.2f s (backing off up to %.0f s); reads continue",
                            size, self.base, e, freed, delay, self._backoff.max_s)
            return
        delay = self._backoff.failed(subdir)
        self._warn_once(f"write-{e.errno}", "kvbackend disk tier: writing a %d-byte block to "
                        "%s/%s failed (%s); writes there retried after %.2f s (backing off up "
                        "to %.0f s)", size, self.base, subdir, e, delay, self._backoff.max_s)

    def get(self, key: str) -> bytes | None:
        """The verified payload, or None (missing, corrupt, unreadable). Never raises
        for environment errors; a bad file is deleted."""
        record = self.get_record(key)
        return None if record is None else record.payload

    def get_record(self, key: str) -> BlockRecord | None:
        """Like ``get``, with the block's ``num_tokens`` (for partial blocks)."""
        return self._read(key, self._read_record)

    def _read_record(self, f: BinaryIO, size: int, key: str) -> BlockRecord:
        record = read_block(f, size, self.identity_digest, key, checksum_key=self.checksum_key,
                            max_payload=self.max_payload)
        if self.payload_sizes and len(record.payload) not in self.payload_sizes:
            raise CorruptBlock(f"payload of {len(record.payload)} bytes, "
                               f"a block holds {sorted(self.payload_sizes)}")
        return record

    def get_into(self, key: str, out: Payload) -> int | None:
        """Like ``get``, but the verified payload lands in ``out`` (a writable,
        C-contiguous buffer of exactly the payload's size: no allocation, no copy
        besides the kernel's). Returns the block's ``num_tokens``, or None on a miss
        (a block of another size is one too), after which the contents of ``out``
        are undefined. O(payload)."""
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("get_into needs a writable buffer")
        return self._read(key, lambda f, size, key: read_block_into(
            f, size, view, self.identity_digest, key, checksum_key=self.checksum_key,
            max_payload=self.max_payload))

    def _read(self, key: str, reader: Callable[[BinaryIO, int, str], _T | None]) -> _T | None:
        """Open ``key``'s file (no link followed, regular files only) and return
        ``reader(file, file size, key)``; every failure, and a None from ``reader``, is
        a miss (a bad file is also deleted). A hit refreshes the key's recency here
        and, through the file's mtime, for other processes."""
        check_key(key)
        result = None
        if self.mode is not DiskMode.DISABLED:
            try:
                with self._subdir(key) as dir_fd:
                    result = self._read_in(key, dir_fd, reader)
            except FileNotFoundError:
                self._forget(key)
            except OSError as e:
                self._warn_once(f"read-{e.errno}", "kvbackend disk tier: reading %s failed: %s",
                                self._path(key), e)
        self._count("misses" if result is None else "hits")
        return result

    def _read_in(self, key: str, dir_fd: int,
                 reader: Callable[[BinaryIO, int, str], _T | None]) -> _T | None:
        try:
            fd, st = open_regular(block_name(key), dir_fd)
        except OSError as e:
            if not is_junk_error(e):
                raise
            self._discard_bad(key, dir_fd, None, "not a regular file")
            return None
        with open(fd, "rb", buffering=0) as f:
            try:
                result = reader(f, st.st_size, key)
            except CorruptBlock as e:
                self._discard_bad(key, dir_fd, st, str(e))
                return None
        if result is not None:
            self._learn(key, st.st_size)
            if self.mode is DiskMode.RW:
                try:  # share recency with other processes and restarts
                    os.utime(block_name(key), dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    pass
        return result

    def contains(self, key: str) -> bool:
        """Whether a block file exists (one ``lstat``; ``get`` does the verification).
        A probe-only tier remembers nothing."""
        check_key(key)
        if self.mode is DiskMode.DISABLED:
            return False
        try:
            st = os.lstat(self._path(key))
        except OSError:
            self._forget(key)
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        if self._index is not None:
            self._index.touch(key, st.st_size, only_if_absent=True)  # another process's
        return True

    def refresh(self, key: str) -> None:
        """Mark ``key`` most recently used in this process's LRU order, if known (a hit
        that reader threads recorded in the order they finished). O(1)."""
        if self._index is not None:
            self._index.refresh(key)

    def contains_prefix(self, keys: list[str]) -> int:
        """Number of leading keys present. O(result + 1) stats."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def remove(self, key: str) -> bool:
        check_key(key)
        self._forget(key)
        if self.mode is not DiskMode.RW:
            return False
        try:
            with self._subdir(key) as fd:
                os.unlink(block_name(key), dir_fd=fd)
            return True
        except OSError:
            return False

    def evict_to(self, max_bytes: int) -> int:
        """Delete least recently used files until the index holds <= max_bytes.

        Returns the number of entries evicted. No-op unless the tier is writable.
        """
        if self.mode is not DiskMode.RW or self._index is None:
            return 0
        victims = self._index.pop_lru(max_bytes)
        for key in victims:
            try:
                with self._subdir(key) as fd:
                    os.unlink(block_name(key), dir_fd=fd)
            except OSError:
                pass  # already gone (another process evicted it) or not removable
        self._count("evictions", len(victims))
        return len(victims)

    @property
    def bytes_used(self) -> int:
        return 0 if self._index is None else self._index.bytes

    def __len__(self) -> int:
        return 0 if self._index is None else len(self._index)

    def keys_lru(self) -> list[str]:
        """Indexed keys, least recently used first. O(n)."""
        return [] if self._index is None else self._index.keys_lru()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the broken invariant: the index's own (its bytes
        are the sum of its sizes), ``mode`` one of the three, a probe-only tier keeps no
        index and never writes, counters never negative. O(#indexed keys). The files
        themselves are the truth and may differ (other processes write and evict)."""
        if self._index is not None:
            self._index.check_invariants()
        if not isinstance(self.mode, DiskMode):
            raise RuntimeError(f"DiskTier: unknown mode {self.mode!r}")
        if self.probe_only and (self._index is not None or self.mode is DiskMode.RW):
            raise RuntimeError(f"DiskTier: probe-only tier in mode {self.mode!r} with an index")
        with self._lock:
            negative = {k: v for k, v in self._counters.items() if v < 0}
        if negative:
            raise RuntimeError(f"DiskTier: negative counters {negative}")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
        return dict(counters, entries=len(self), bytes=self.bytes_used, max_bytes=self.max_bytes,
                    bound=self._bound, mode=self.mode, probe_only=self.probe_only,
                    directory=self.base, identity=self.identity_digest)


def _regular_file_size(name: str, dir_fd: int) -> int | None:
    """The size of the regular file ``name`` in ``dir_fd``; None if absent or not a
    regular file (a link or FIFO there is replaced by the write that follows)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _rescan_loop(tier_ref: weakref.ref, stop: threading.Event, interval_s: float) -> None:
    """Rescan the tier every ``interval_s``, or 10x as long as the last rescan took if
    that is longer (a huge directory costs at most ~10% of a core), until stopped or
    the tier is collected."""
    wait_s = interval_s
    while not stop.wait(wait_s):
        tier = tier_ref()
        if tier is None:
            return
        start = time.monotonic()
        try:
            tier.rescan()
        except Exception:  # noqa: BLE001 - a failed rescan must not end the rescans
            logger.exception("kvbackend disk tier: rescan of %s failed", tier.base)
        del tier
        wait_s = max(interval_s, _RESCAN_DUTY * (time.monotonic() - start))


def _release(stop: threading.Event, declaration: BoundDeclaration | None) -> None:
    stop.set()
    if declaration is not None:
        declaration.withdraw()
