"""What the tier planner and the tier workers say to each other, as plain values.

The planner (scheduler process) turns vLLM's scheduling decisions into one
``StepOrders`` per step; vLLM ships it to every worker inside the step's
``KVConnectorMetadata``. Everything here is a NamedTuple, a tuple or an Enum:
immutable, cheap to pickle, and free of vLLM imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple


class Source(Enum):
    """The tier a hit block is loaded from (the connector maps it to vLLM's CacheHitSource)."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class LoadOrder(NamedTuple):
    """Fill block ``block_id`` (all layers) with ``key``'s KV, from host memory, else
    from disk, else from the remote tier; with ``promote``, a block read from disk or
    the remote tier is kept in host memory too. ``physical``: with several KV-cache
    groups, its block in each (``block_id`` is then kvbackend's logical id; a 0: that
    group no longer holds the block, or, in a state group, its page is not loaded: see
    ``BlockMover``). ``checkpoint``: ``key`` is a ``checkpoint_key``, whose state pages
    are loaded too (the last block of a Mamba / linear-attention hybrid's hit)."""

    request_id: str
    block_id: int
    key: str
    promote: bool
    physical: tuple[int, ...] = ()
    checkpoint: bool = False

    @property
    def blocks(self) -> int | tuple[int, ...]:
        """What the workers move: ``BlockMover``'s ``BlockRef``."""
        return self.physical or self.block_id


class SaveOrder(NamedTuple):
    """Copy block ``block_id`` (all layers, complete after this step's forward pass)
    into the host, disk and/or remote tier under ``key``; ``physical`` as for
    ``LoadOrder`` (never a 0: a block some group no longer holds is not saved);
    ``checkpoint``: ``key`` is a ``checkpoint_key`` (a step of the request ended on the
    block's last token, so its state pages hold the state there)."""

    request_id: str
    block_id: int
    key: str
    to_host: bool
    to_disk: bool
    to_remote: bool = False
    physical: tuple[int, ...] = ()
    checkpoint: bool = False

    @property
    def blocks(self) -> int | tuple[int, ...]:
        return self.physical or self.block_id


class StepOrders(NamedTuple):
    """One step's orders; every worker applies them in field order:

    before the forward pass: ``clear_host`` (empty the host tier), ``disk_off`` (stop
    reading and writing the disk and remote tiers for good), ``drops`` (keys to remove
    from the host tier), ``loads``, and ``failed`` ((request id, block id) pairs to
    report as failed loads without trying); after it: ``saves``, then ``prefetches``
    ((key, whether a checkpoint copy) pairs to read from disk into the host tier, kept
    only if they verify: a waiting request's blocks, off the forward pass).
    ``async_loads``: the requests whose loads vLLM awaits asynchronously (those with a
    remote hit; every hit with several KV-cache groups): their host and disk blocks load
    with the others, their remaining blocks come from the remote tier in the
    background, and each worker reports the request finished once they arrived (or
    missed: failed loads, recomputed).
    """

    clear_host: bool = False
    disk_off: bool = False
    drops: tuple[str, ...] = ()
    loads: tuple[LoadOrder, ...] = ()
    failed: tuple[tuple[str, int], ...] = ()
    saves: tuple[SaveOrder, ...] = ()
    async_loads: tuple[str, ...] = ()
    prefetches: tuple[tuple[str, bool], ...] = ()


class TierFact(NamedTuple):
    """What the planner learned of a disk or remote key: the tier holds it, with device
    block ``block_id`` holding the same KV (a load from there), or it does not
    (``block_id`` None: a probe missed it, or its load failed). For KV events."""

    source: Source
    key: str
    block_id: int | None


class ScheduledRequest(NamedTuple):
    """A request scheduled in the step being planned, as the planner needs it."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    block_ids: Sequence[int]  # the request's whole block table
    # with several KV-cache groups: each block's physical block per group (LoadOrder)
    physical: Sequence[tuple[int, ...]] = ()


__all__ = ["LoadOrder", "SaveOrder", "ScheduledRequest", "Source", "StepOrders", "TierFact"]
