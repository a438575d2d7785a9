"""Encode, atomically write, and verify one block file (format v2).

The byte layout and the reasons behind it are in the docstring of
:mod:`kvbackend.store.disk_tier`; this module is its only implementation.
Functions here raise; the tier turns every failure into a miss.
"""

from __future__ import annotations

import os
import secrets
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from blake3 import blake3

from kvbackend.store.tier import Payload

MAGIC = b"KVBLOCK\x00"
FORMAT_VERSION = 2
HEADER_LEN = 128
_PREFIX = struct.Struct("<8sHHI32s32sII Q")  # everything before the checksum
_CHECKSUM_OFF = _PREFIX.size  # 96
assert _CHECKSUM_OFF == 96 and _CHECKSUM_OFF + 32 == HEADER_LEN
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
MAX_NUM_TOKENS = 2**32 - 1


class CorruptBlock(Exception):
    """A block file that must not be used; ``str(e)`` says why."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    identity_digest: str
    key: str
    num_tokens: int
    payload: bytes


def block_path(base: str, key: str) -> str:
    """``<base>/<key[:2]>/<key>.kvb``, where ``base`` is ``<dir>/v2/<identity digest>``."""
    return os.path.join(base, key[:2], key + SUFFIX)


def as_byte_view(payload: Payload) -> memoryview:
    """A flat, C-contiguous byte view of the payload (copies only if not contiguous)."""
    if isinstance(payload, np.ndarray):
        if payload.dtype.hasobject:
            raise TypeError(f"payload array must hold plain data, got dtype {payload.dtype}")
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    view = memoryview(payload)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


def _checksum(prefix: bytes, payload: bytes | memoryview) -> bytes:
    """BLAKE3 (32 bytes) of header bytes 0..95 + payload; releases the GIL while it hashes."""
    h = blake3(prefix)
    h.update(payload)
    return h.digest()


def encode_header(identity_digest: str, key: str, num_tokens: int, payload: memoryview) -> bytes:
    """The 128-byte header for ``payload``, checksum included. O(len(payload))."""
    if not 0 <= num_tokens <= MAX_NUM_TOKENS:
        raise ValueError(f"num_tokens must lie in [0, {MAX_NUM_TOKENS}], got {num_tokens}")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_LEN, 0, bytes.fromhex(identity_digest),
                          bytes.fromhex(key), num_tokens, 0, payload.nbytes)
    return prefix + _checksum(prefix, payload)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def write_block_atomic(path: str, header: bytes, payload: memoryview, *, durable: bool) -> None:
    """Write header + payload to ``path`` so that readers see all of it or nothing.

    Unique temp file in the same directory (``.<name>.<pid>.<random>.tmp``),
    fsync, ``os.replace``, fsync of the directory (the last two only if
    ``durable``). On any error the temp file is removed and the error re-raised.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                  f"{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, memoryview(header))
            _write_all(fd, payload)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass  # the data is complete; only the rename's durability is at stake


def _read_exact(f: BinaryIO, n: int) -> bytes:
    first = f.read(n)
    if len(first) == n or not first:
        return first
    parts, got = [first], len(first)
    while got < n and (chunk := f.read(n - got)):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _readinto_exact(f: BinaryIO, out: memoryview) -> int:
    """Fill ``out`` from ``f``; returns the bytes read (< len(out) only at end of file)."""
    got = 0
    while got < out.nbytes and (n := f.readinto(out[got:])):
        got += n
    return got


@dataclass(frozen=True, slots=True)
class _Header:
    raw: bytes  # the 128 header bytes, checksum included
    identity_digest: str
    key: str
    num_tokens: int
    payload_len: int


def _read_header(f: BinaryIO, file_size: int, identity_digest: str | None,
                 key: str | None) -> _Header:
    """Read and check the header (all but the checksum); raises ``CorruptBlock``. O(1)."""
    header = _read_exact(f, HEADER_LEN)
    if len(header) < HEADER_LEN:
        raise CorruptBlock(f"short header: {len(header)} of {HEADER_LEN} bytes")
    (magic, version, header_len, _flags, ident_raw, key_raw, num_tokens, _reserved,
     payload_len) = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, expected {FORMAT_VERSION}")
    if header_len != HEADER_LEN:
        raise CorruptBlock(f"header length {header_len}, expected {HEADER_LEN}")
    if identity_digest is not None and ident_raw.hex() != identity_digest:
        raise CorruptBlock(f"identity {ident_raw.hex()[:12]}.. in file, "
                           f"expected {identity_digest[:12]}..")
    if key is not None and key_raw.hex() != key:
        raise CorruptBlock(f"key {key_raw.hex()[:12]}.. in file, expected {key[:12]}..")
    if payload_len != file_size - HEADER_LEN:
        raise CorruptBlock(f"payload length {payload_len} in header, "
                           f"but {file_size - HEADER_LEN} bytes follow the header")
    return _Header(header, ident_raw.hex(), key_raw.hex(), num_tokens, payload_len)


def _check_payload(header: _Header, payload: bytes | memoryview, got: int) -> None:
    """Raise ``CorruptBlock`` unless all ``got`` payload bytes arrived and match the
    checksum. O(payload)."""
    if got != header.payload_len:
        raise CorruptBlock(f"truncated payload: {got} of {header.payload_len} bytes")
    if _checksum(header.raw[:_CHECKSUM_OFF], payload) != header.raw[_CHECKSUM_OFF:HEADER_LEN]:
        raise CorruptBlock(f"checksum mismatch over {header.payload_len} payload bytes")


def read_block(f: BinaryIO, file_size: int, identity_digest: str | None = None,
               key: str | None = None) -> BlockRecord:
    """Read and verify one block file from ``f`` (positioned at 0).

    Checks magic, version, header length, identity and key (when given), that
    the payload length matches the file size, and the checksum; raises
    ``CorruptBlock`` naming the first failed check. O(file size).
    """
    header = _read_header(f, file_size, identity_digest, key)
    payload = _read_exact(f, header.payload_len)
    _check_payload(header, payload, len(payload))
    return BlockRecord(header.identity_digest, header.key, header.num_tokens, payload)


def read_block_into(f: BinaryIO, file_size: int, out: memoryview,
                    identity_digest: str | None = None, key: str | None = None) -> int | None:
    """``read_block`` straight into ``out`` (a writable 1-D byte view): no allocation
    and no copy besides the kernel's. Returns the block's num_tokens, or None,
    reading no payload, for a sound header announcing a payload of another size
    than ``out`` (a partial block, say: not corrupt, just not what the caller wants).

    Same checks as ``read_block``; after a ``CorruptBlock`` the contents of ``out``
    are undefined. O(file size).
    """
    header = _read_header(f, file_size, identity_digest, key)
    if header.payload_len != out.nbytes:
        return None
    _check_payload(header, out, _readinto_exact(f, out))
    return header.num_tokens


def verify_file(path: str, identity_digest: str | None = None,
                key: str | None = None) -> BlockRecord:
    """Open ``path`` and ``read_block`` it; raises CorruptBlock or OSError."""
    with open(path, "rb", buffering=0) as f:
        return read_block(f, os.fstat(f.fileno()).st_size, identity_digest, key)
