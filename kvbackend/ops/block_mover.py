"""Whole KV blocks (all layers) between a paged KV cache and the host/disk tiers.

``BlockMover`` is what a worker runs to load tier blocks into freshly allocated
cache blocks and to save computed ones. Host payloads are numpy uint8 arrays of
``block_nbytes``; a CPU cache is gathered into and scattered from them directly.
A GPU cache (the tiers always live in host memory, pinned then) moves blocks through
``STAGED_BLOCKS`` device staging blocks: each loaded payload is copied into one, and
one scatter per ``STAGED_BLOCKS`` loads writes them into the cache; saves gather up to
``STAGED_BLOCKS`` blocks with one kernel and copy each out, one sync per group.

A block is named by a ``BlockRef``: an int, one physical block of every layer, or,
with several KV-cache groups sharing the layers' tensors (vLLM's hybrid KV-cache
manager, ``kvbackend.vllm.block_groups``), a tuple of one physical block per group:
one payload then holds every group's KV of those tokens, group by group. A 0 in a
tuple (vLLM's null block: a sliding-window group no longer holds those tokens) is
skipped by loads, which fill the other groups; such a block is never saved.

A Mamba / linear-attention hybrid's ``state_groups`` hold a running state, which only
a block a step ended on holds usefully (``kvbackend/vllm/state_checkpoints.py``). Its
payloads come in two shapes, chosen per call by ``whole``: a whole one holds every
group's page (a checkpoint copy), an ordinary one the other groups' pages only, in
group order (``ordinary_nbytes``), and a load of it leaves the state pages untouched.
Without state groups both shapes are the same.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from kvbackend.ops.block_copy import BlockCopier, extension_available
from kvbackend.ops.pinned_rows import PinnedRows
from kvbackend.store import DiskTier, HostTier

# Threads reading and verifying disk blocks ahead of the scatters: half the usable cores,
# 2 to 8. On a 16-core H200 machine disk loads of 16 MiB blocks ran at 4.3 / 7.0 / 14.2 GB/s
# with 2 / 4 / 8 readers (2 MiB blocks: 4.4 / 6.8 / 7.0; bench_block_mover.py).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
READERS = min(8, max(2, (_CORES or 2) // 2))
STAGED_BLOCKS = 8  # device staging blocks of a GPU cache: loads scattered per call

BlockRef = int | tuple[int, ...]  # a physical block, or one per KV-cache group (module doc)


class BlockMover:
    """A worker's byte mover between its KV cache and its host/disk tiers.

    Every block is given with ``whole`` (the module docstring: which payload shape).

    * ``load_many``: a host payload is scattered straight from host memory; a disk
      block is read (``readinto``) and verified in place, into a fresh array when
      it is promoted to host, else into a reused staging row, then scattered. Disk
      reads run ahead on ``READERS`` threads (``readinto`` and BLAKE3 release the
      GIL), at most ``2 * READERS`` blocks ahead of the scatters, in order.
    * ``load_payloads``: blocks another tier handed over in memory (the remote
      tier's verified values) are copied into a row (kept in host if promoted) and
      scattered.
    * ``prefetch``: disk blocks are read (and verified) into fresh arrays the host
      tier keeps, touching no cache block.
    * ``save_many``: each block is gathered straight into the array the host tier
      keeps (or into a staging row when it goes to disk only) and written from there;
      ``gather_many`` copies blocks into fresh rows (for the remote tier's writer).

    On a CPU cache a block costs one memcpy, plus one checksum pass when it comes
    from or goes to disk; apart from the arrays the host tier keeps, nothing is
    allocated per block. On a GPU cache a load from an array the host tier keeps is
    an asynchronous copy (the mover holds the array until the copies are done: one
    stream synchronization per call); from a reused staging row, a synchronous one.

    Invariants: the host tier holds only arrays made here (1-D, uint8, of one of the
    two payload sizes, writable); between calls nothing is staged and no copy reads
    host memory. Calls must not overlap; O(payload bytes) per block.
    """

    def __init__(self, layers: list[torch.Tensor], block_dim: int, block_nbytes: int,
                 block_size: int, host: HostTier | None, disk: DiskTier | None,
                 state_groups: Collection[int] = ()) -> None:
        self.layers, self.block_dim = layers, block_dim
        self.block_nbytes, self.block_size = block_nbytes, block_size
        self.host, self.disk = host, disk
        self.device = layers[0].device
        self.copier = BlockCopier(layers, block_dim)
        extension_available()  # built (once per install) and loaded now, not in a step's save
        page_nbytes = self.copier.layout.block_nbytes  # one physical block of every layer
        # physical blocks per BlockRef: one per KV-cache group
        self.num_groups, rest = divmod(block_nbytes, page_nbytes)
        if rest or not self.num_groups:
            raise ValueError(f"a block of {block_nbytes} bytes is not a whole number of "
                             f"physical blocks of {page_nbytes} bytes")
        state = set(state_groups)
        ordinary = [g for g in range(self.num_groups) if g not in state]
        if not ordinary or len(ordinary) + len(state) != self.num_groups:
            raise ValueError(f"state groups {sorted(state_groups)} are not some of the "
                             f"{self.num_groups} KV-cache groups")
        # the groups an ordinary payload holds (None: every group)
        self._ordinary = torch.tensor(ordinary) if state else None
        self.ordinary_nbytes = page_nbytes * len(ordinary)
        self._pinned = None if self.device.type == "cpu" else {
            nbytes: PinnedRows(nbytes) for nbytes in {block_nbytes, self.ordinary_nbytes}}
        self._device_rows = (None if self.device.type == "cpu" else torch.empty(
            STAGED_BLOCKS * self.num_groups, page_nbytes, dtype=torch.uint8,
            device=self.device))
        # blocks per gather: one device-to-host sync per group on a GPU
        self._gather_group = 1 if self._device_rows is None else STAGED_BLOCKS
        self._staging = [self._new_row(block_nbytes)
                         for _ in range(max(2 * READERS, self._gather_group))]
        # the physical blocks whose bytes wait in _device_rows, in order, per payload
        self._staged: list[torch.Tensor] = []
        self._staged_ids: set[int] = set()
        self._staged_pages = 0
        self._copying: list[np.ndarray] = []  # host rows async copies may still read
        self._readers: ThreadPoolExecutor | None = None

    @property
    def pinned_nbytes(self) -> int:
        """Host memory pinned for this mover's rows (0 on a CPU cache)."""
        return sum(rows.pinned_nbytes for rows in (self._pinned or {}).values())

    def payload_nbytes(self, whole: bool) -> int:
        """Bytes of a whole payload, or of an ordinary one (the module docstring)."""
        return self.block_nbytes if whole else self.ordinary_nbytes

    def load_many(self, loads: list[tuple[BlockRef, str, bool, bool]]) -> list[bool]:
        """For each (block, key, promote, whole): fill that block of every layer with the
        key's bytes from host, else disk (then kept in host too if ``promote``).
        Returns, per load, whether it succeeded; a failed one leaves its block
        untouched."""
        done = [False] * len(loads)
        reads: deque[tuple[int, Future, np.ndarray, int]] = deque()  # slot -1: kept
        try:
            for i, (block, key, promote, whole) in enumerate(loads):
                row = self._host_row(key, whole)
                if row is not None:
                    self._scatter(row, self._payload_ids(block, whole), kept=True)
                    done[i] = True
                elif self.disk is not None:
                    if len(reads) == len(self._staging):
                        self._finish_oldest(reads, loads, done)
                    nbytes = self.payload_nbytes(whole)
                    keep = promote and self.host is not None
                    slot = -1 if keep else self._free_slot(reads)
                    row = self._new_row(nbytes) if keep else self._staging[slot][:nbytes]
                    reads.append((i, self._reader().submit(self.disk.get_into, key, row),
                                  row, slot))
            while reads:
                self._finish_oldest(reads, loads, done)
            self._flush()
        finally:  # after an error too: no read or copy may still use a row
            wait([read for _, read, _, _ in reads])
            self._settle()
        return done

    def load_payloads(self, loads: list[tuple[BlockRef, str, memoryview, bool, bool]]
                      ) -> list[bool]:
        """For each (block, key, payload, promote, whole): fill that block of every layer
        with the payload (and keep a copy in host if ``promote``). Returns, per load,
        whether it did: not when the payload's size is not its shape's."""
        placed = [False] * len(loads)
        try:
            for i, (block, key, payload, promote, whole) in enumerate(loads):
                nbytes = self.payload_nbytes(whole)
                if payload.nbytes != nbytes:
                    continue
                keep = promote and self.host is not None
                row = self._new_row(nbytes) if keep else self._staging[0][:nbytes]
                row[:] = np.frombuffer(payload, dtype=np.uint8)
                if keep:
                    self.host.put(key, row, self.block_size)
                self._scatter(row, self._payload_ids(block, whole), kept=keep)
                placed[i] = True
            self._flush()
        finally:
            self._settle()
        return placed

    def prefetch(self, keys: list[tuple[str, bool]]) -> list[bool]:
        """For each (key, whole) the host tier lacks: read it from disk into the host
        tier (verified; a block that misses or fails its check is skipped). Returns, per
        key, whether it put it. O(read bytes)."""
        put = [False] * len(keys)
        if self.host is None or self.disk is None:
            return put
        for i, (key, whole) in enumerate(keys):
            if not self.host.contains(key):
                row = self._new_row(self.payload_nbytes(whole))
                if self.disk.get_into(key, row) is not None:
                    put[i] = self.host.put(key, row, self.block_size)
        return put

    def gather_many(self, blocks: list[tuple[BlockRef, bool]]) -> list[np.ndarray]:
        """A fresh host copy of each (block, whole) of ``blocks`` (every layer), in order."""
        rows = [self._new_row(self.payload_nbytes(whole)) for _, whole in blocks]
        ids = [self._payload_ids(block, whole) for block, whole in blocks]
        for start in range(0, len(blocks), self._gather_group):
            part = slice(start, start + self._gather_group)
            self._gather(ids[part], rows[part])
        return rows

    def save_many(self, saves: list[tuple[BlockRef, str, bool, bool, bool]]) -> None:
        """For each (block, key, to host, to disk, whole), in order: copy that block of
        every layer into the host tier and/or the disk tier (a tier the mover lacks is
        skipped)."""
        saves = [(block, key, to_host and self.host is not None,
                  to_disk and self.disk is not None, whole)
                 for block, key, to_host, to_disk, whole in saves]
        saves = [save for save in saves if save[2] or save[3]]
        for start in range(0, len(saves), self._gather_group):
            part = saves[start:start + self._gather_group]
            sizes = [self.payload_nbytes(whole) for *_, whole in part]
            rows = [self._new_row(n) if to_host else self._staging[i][:n]
                    for i, ((_, _, to_host, _, _), n) in enumerate(zip(part, sizes))]
            self._gather([self._payload_ids(block, whole) for block, *_, whole in part], rows)
            for (_, key, to_host, to_disk, _), row in zip(part, rows):
                if to_host:
                    self.host.put(key, row, self.block_size)
                if to_disk:
                    self.disk.put(key, row, self.block_size)

    def _new_row(self, nbytes: int) -> np.ndarray:
        """A host buffer of ``nbytes`` (a payload size): a pinned row (``PinnedRows``)
        when the cache is on a GPU, plain numpy memory otherwise."""
        if self._pinned is None:
            return np.empty(nbytes, dtype=np.uint8)
        return self._pinned[nbytes].take()

    def _host_row(self, key: str, whole: bool) -> np.ndarray | None:
        payload = None if self.host is None else self.host.get(key)
        if isinstance(payload, np.ndarray) and payload.nbytes == self.payload_nbytes(whole):
            return payload
        return None

    def _free_slot(self, reads: deque[tuple[int, Future, np.ndarray, int]]) -> int:
        """A staging row no read in flight uses (there is one: fewer reads than rows)."""
        busy = {slot for *_, slot in reads}
        return next(slot for slot in range(len(self._staging)) if slot not in busy)

    def _finish_oldest(self, reads: deque[tuple[int, Future, np.ndarray, int]],
                       loads: list[tuple[BlockRef, str, bool, bool]], done: list[bool]) -> None:
        """Wait for the oldest disk read; scatter it (and keep it in host) if it verified."""
        i, read, row, slot = reads.popleft()
        if read.result() is None:
            return
        block, key, _, whole = loads[i]
        # The reader threads recorded their hits in the order they finished: record them
        # again in the loads' order, so the disk tier's LRU order does not vary by run.
        self.disk.refresh(key)
        keep = slot < 0
        if keep:  # disk bytes are immutable: the host tier keeps this very array
            self.host.put(key, row, self.block_size)
        self._scatter(row, self._payload_ids(block, whole), kept=keep)
        done[i] = True

    def _reader(self) -> ThreadPoolExecutor:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvbackend-read")
        return self._readers

    def _scatter(self, row: np.ndarray, ids: torch.Tensor, kept: bool) -> None:
        """Host bytes ``row`` -> physical blocks ``ids`` (a payload's, ``_payload_ids``) of
        every layer: at once on a CPU cache; on a GPU, staged (asynchronously when
        ``kept``: a row the mover does not reuse) and scattered by ``_flush``."""
        source = torch.from_numpy(row)
        if self._device_rows is None:
            self.copier.scatter(*self._held_groups(source, ids))
            return
        pages, held = len(ids), {i for i in ids.tolist() if i}
        if held & self._staged_ids or self._staged_pages + pages > len(self._device_rows):
            self._flush()
        # Stream order: this copy runs after the scatter that read the rows before.
        start = self._staged_pages
        self._device_rows[start:start + pages].view(-1).copy_(source, non_blocking=kept)
        self._staged.append(ids)
        self._staged_ids |= held
        self._staged_pages += pages
        if kept:
            self._copying.append(row)

    def _flush(self) -> None:
        """Scatter the staged blocks into the cache (queued on the current stream)."""
        if self._staged:
            rows = self._device_rows[:self._staged_pages]
            self.copier.scatter(*self._held_groups(rows, torch.cat(self._staged)))
            self._unstage()

    def _unstage(self) -> None:
        self._staged.clear()
        self._staged_ids.clear()
        self._staged_pages = 0

    def _settle(self) -> None:
        """End of a load call: drop what was staged and not flushed (after an error),
        and wait for the copies that read host rows, so those rows may go."""
        self._unstage()
        if self._copying:
            torch.cuda.current_stream(self.device).synchronize()
            self._copying.clear()

    def _gather(self, ids: list[torch.Tensor], rows: list[np.ndarray]) -> None:
        """Physical blocks ``ids[i]`` (a payload's) of every layer -> host bytes
        ``rows[i]``, at most ``_gather_group`` payloads: on a CPU cache straight into the
        row; on a GPU, one gather into the staging rows, a device-to-host copy per row,
        one sync."""
        if self.num_groups > 1 and any(not bool(i.all()) for i in ids):
            raise ValueError(f"cannot save a block some KV-cache group no longer holds (a 0 "
                             f"among {[i.tolist() for i in ids]})")
        if self._device_rows is None:
            for block_ids, row in zip(ids, rows):
                self.copier.gather(block_ids, torch.from_numpy(row))
            return
        flat = torch.cat(ids)
        staged = self.copier.gather(flat, self._device_rows[:len(flat)])
        start = 0
        for block_ids, row in zip(ids, rows):  # pinned rows: asynchronous copies
            pages = staged[start:start + len(block_ids)]
            torch.from_numpy(row).copy_(pages.view(-1), non_blocking=True)
            start += len(block_ids)
        torch.cuda.current_stream(self.device).synchronize()

    def _ids(self, block: BlockRef) -> torch.Tensor:
        """The physical blocks of ``block``, one per KV-cache group (0: none there)."""
        ids = (block,) if isinstance(block, int) else tuple(block)
        if len(ids) != self.num_groups:
            raise ValueError(f"block {block!r} names {len(ids)} physical blocks, a tier block "
                             f"here spans {self.num_groups} KV-cache groups")
        return torch.tensor(ids, dtype=torch.int64)

    def _payload_ids(self, block: BlockRef, whole: bool) -> torch.Tensor:
        """The physical blocks, in payload order, that a payload of ``block`` holds."""
        ids = self._ids(block)
        return ids if whole or self._ordinary is None else ids[self._ordinary]

    def _held_groups(self, rows: torch.Tensor,
                     ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (``len(ids)`` physical blocks' bytes) and ``ids`` without the blocks
        whose id is 0 (with several groups: vLLM's null block, the group no longer holds
        those tokens). O(bytes kept) when one is left out, else O(1)."""
        held = ids != 0
        if self.num_groups == 1 or bool(held.all()):
            return rows, ids
        return rows.reshape(len(ids), -1)[held.to(rows.device)], ids[held]


__all__ = ["BlockMover", "BlockRef", "READERS", "STAGED_BLOCKS"]
