"""The device blocks the step being scheduled writes, and from which slot.

A partial hit is served by copying the first slots of a cached block before the
step's forward pass. That copy is valid only if those slots were written by an
earlier step (or, under async scheduling, by the step still in flight, which runs
first): a block this step writes from slot ``o`` on still serves a hit reading
its first ``n <= o`` slots. A writer appending to its last block (a conversation
still decoding, a continuation that copied a prefix's block) thus never cuts back
a hit on the slots it wrote before.

Under async scheduling with draft tokens the scheduler's computed count may run
ahead of the worker's, so the first slot recorded may lie past the one really
written first; a hit reads only published tokens, whose ids are known, and the
worker writes at or past the first unknown one, so it never reads a slot the
step writes.

A partial hit's copy writes the first slots of its destination in this step too,
and vLLM runs a step's copies all at once (every source read before any destination
is written), so a copy's destination counts as written from slot 0: no hit in the
same step copies from it, whatever lists it by then.

Invariant: ``first_slot[b]`` is the lowest slot of block ``b`` recorded this step.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepWrites:
    """Blocks written in the step being scheduled. O(1) per block and per query."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.first_slot: dict[int, int] = {}

    def add(self, block_ids: Iterable[int], first_position: int = 0) -> None:
        """``block_ids`` are written, the first of them from token position
        ``first_position`` (its slot ``first_position % block_size``), the rest whole."""
        slot = first_position % self.block_size
        for block_id in block_ids:
            self.first_slot[block_id] = min(slot, self.first_slot.get(block_id, slot))
            slot = 0

    def __contains__(self, block_id: int) -> bool:
        """Whether the step writes any slot of ``block_id``."""
        return block_id in self.first_slot

    def overwrites(self, block_id: int, num_slots: int) -> bool:
        """Whether the step writes one of the first ``num_slots`` slots of ``block_id``:
        a partial hit reading them must not copy it."""
        return self.first_slot.get(block_id, num_slots) < num_slots

    def clear(self) -> None:
        self.first_slot.clear()
