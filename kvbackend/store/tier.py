"""The interface every KV tier store implements (host memory, local disk, ...).

Keys are 64-hex-char block keys (:mod:`kvbackend.store.block_key`); payloads
are opaque bytes-like objects or numpy arrays: a tier never interprets them.
A tier is a cache: ``put`` may refuse (returns False) and ``get`` may miss at
any time, and neither raises for conditions of the environment (full disk,
corrupted file, another process evicting). They raise only for caller errors
(a malformed key, a negative token count).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

Payload = Union[bytes, bytearray, memoryview, np.ndarray]


def payload_nbytes(payload: Payload) -> int:
    """Size in bytes of a payload. O(1)."""
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    if isinstance(payload, memoryview):
        return payload.nbytes
    if isinstance(payload, (bytes, bytearray)):
        return len(payload)
    raise TypeError(f"payload must be bytes, bytearray, memoryview or ndarray, got {type(payload)}")


def check_payload_sizes(sizes: Collection[int] | None) -> frozenset[int]:
    """``sizes`` (the payload sizes a tier's blocks may have; None: any) as a set
    (empty: any). Raises ``ValueError`` unless each is a positive int."""
    if sizes is None:
        return frozenset()
    if isinstance(sizes, (int, str, bytes)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"payload_sizes must be positive ints, got {sizes!r}")
    if not sizes:
        raise ValueError("payload_sizes must name at least one size (None: any size)")
    return frozenset(sizes)


def check_key(key: str) -> str:
    """Raise ``ValueError`` unless ``key`` is 64 lowercase hex chars (a block key)."""
    if not isinstance(key, str) or len(key) != 64 or key.strip("0123456789abcdef"):
        raise ValueError(f"block key must be 64 lowercase hex chars, got {key!r}")
    return key


@runtime_checkable
class TierStore(Protocol):
    """A bounded key -> payload cache with LRU eviction by bytes."""

    def put(self, key: str, payload: Payload, num_tokens: int) -> bool:
        """Store ``payload`` (the KV of a block holding ``num_tokens`` tokens); False if refused."""

    def get(self, key: str) -> Payload | None:
        """The payload for ``key``, or None on a miss. A hit marks the key most recently used."""

    def contains(self, key: str) -> bool:
        """Whether ``key`` is (probably) present. Does not change LRU order."""

    def contains_prefix(self, keys: list[str]) -> int:
        """Number of leading keys of ``keys`` that are present."""

    def remove(self, key: str) -> bool:
        """Drop ``key``; True if it was present."""

    def evict_to(self, max_bytes: int) -> int:
        """Evict least recently used entries until at most ``max_bytes`` remain; return #evicted."""

    def stats(self) -> dict[str, Any]:
        """Counters and sizes, JSON-serialisable."""
