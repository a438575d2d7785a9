"""Where the HiCache storage backend keeps its pages: the disk tier or the remote tier, behind
the few batched calls the backend makes.

Both take kvbackend's block keys and store kvbackend's block format (header with
identity, key and checksum; every read verified, a bad value is a miss and is
deleted), so a page written by one instance is found, and checked, by another.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvbackend.store import DiskTier
from kvbackend.store.remote_tier import RemoteTier
from kvbackend.store.tier import Payload

logger = logging.getLogger("kvbackend.sglang")


class DiskPages:
    """Pages in a ``DiskTier``: one file each, LRU-bounded. O(1) syscalls per page."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.identity_digest = tier.identity_digest

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self.tier.contains_prefix(list(keys))

    def read_many(self, keys: Sequence[str],
                  targets: Sequence[np.ndarray | None]) -> list[Payload | None]:
        """Each verified payload, read straight into its target (a uint8 array of the
        page's size) when one is given; None for a miss, a bad file, another size."""
        return [self.tier.get(k) if t is None
                else (t if self.tier.get_into(k, t) is not None else None)
                for k, t in zip(keys, targets)]

    def put_many(self, pages: Sequence[tuple[str, Payload, int]]) -> list[bool]:
        return [self.tier.put(k, p, n) for k, p, n in pages]

    def clear(self) -> None:
        self.tier.evict_to(0)


class RemotePages:
    """Pages in a ``RemoteTier`` (Redis / Valkey): one pipelined round trip per call. A
    server that is away is a miss (reads) or a failed backup (writes), never an error."""

    def __init__(self, tier: RemoteTier) -> None:
        self.tier = tier
        self.identity_digest = tier.identity_digest

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self.tier.contains_many(keys)

    def read_many(self, keys: Sequence[str],
                  targets: Sequence[np.ndarray | None]) -> list[Payload | None]:
        """As ``DiskPages.read_many``, in one round trip (a copy into each target)."""
        found = self.tier.get_many(keys)
        out: list[Payload | None] = []
        for key, payload, target in zip(keys, found, targets):
            if payload is not None and target is not None:
                if target.nbytes != payload.nbytes:
                    logger.warning("kvbackend HiCache storage: page %s holds %d bytes, the "
                                   "target %d", key, payload.nbytes, target.nbytes)
                    payload = None
                else:
                    target[:] = np.frombuffer(payload, dtype=np.uint8)
                    payload = target
            out.append(payload)
        return out

    def put_many(self, pages: Sequence[tuple[str, Payload, int]]) -> list[bool]:
        """All True only when the server took every page (it reports a count)."""
        stored = self.tier.put_many(pages)
        return [stored == len(pages)] * len(pages)

    def clear(self) -> None:
        """The server's pages stay (other instances share them); its LRU retires them."""
        logger.info("kvbackend HiCache storage: clear() leaves the pages in %s (shared; the "
                    "server's maxmemory policy retires them)", self.tier.url)


__all__ = ["DiskPages", "RemotePages"]
