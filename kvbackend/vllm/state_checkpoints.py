"""Which tree blocks of a Mamba / linear-attention hybrid hold a usable recurrent state.

A state layer (Mamba, Gated DeltaNet) keeps one running value per request, not
KV per token. vLLM's ``mamba_cache_mode="align"`` workers keep it in the state
group's block of the step's last token: before a step they copy the state from
the block of the previous step's last token into the block of this step's last
token, if they differ (``preprocess_mamba``), then the step updates it in place.
So the state page of a request's block *i* ends up holding the state after
exactly ``(i + 1) * block_size`` tokens when, and only when, a step of that
request ended on that boundary: no later step writes it (the next one copies
the state forward into block *i* + 1), and other requests only read it (as the
source of their first copy). vLLM's scheduler ends prefill chunks on block
boundaries in this mode, and a decode step (one token) ends on each boundary it
reaches; any other block holds a state from inside the block, which no hit can
resume from.

``StateCheckpoints`` records these blocks by logical id (one logical block is
one physical block per KV-cache group, ``block_groups.py``), and a hit of a
hybrid model ends on the longest recorded boundary of its match (the manager
admits it only once the step writing that checkpoint has run). When the tree
lists another block for the same tokens (a sibling computed them first, with no
step ending there), the checkpoint is copied into that block at the start of the
next step, once the step that writes it has run (``copy_to``): no step writes a
full tree block's state page otherwise.

Invariants (``check_invariants``): every recorded block id is a valid logical
id other than the null block 0; a block handed out again (newly allocated to a
request) is no longer recorded, nor the destination of a pending copy
(``forget``), so a record always names the step, or the copy, that wrote the
block's current state page.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class StateCheckpoints:
    """The set of logical blocks whose state page holds the state at their last token.
    Every operation is O(blocks it is given)."""

    def __init__(self, block_size: int, num_logical_blocks: int) -> None:
        self.block_size = block_size
        self.num_logical_blocks = num_logical_blocks
        self._blocks: set[int] = set()
        self._copies_next: list[tuple[int, int]] = []  # (src, dst), due next step
        self._copies_due: list[tuple[int, int]] = []  # due in the current step

    def add(self, block_id: int) -> None:
        """A step ending on ``block_id``'s last token was scheduled."""
        self._blocks.add(block_id)

    def copy_to(self, src: int, dst: int) -> None:
        """``dst`` holds ``src``'s checkpoint once the next step's copies ran (``src`` is
        written by the current one)."""
        self._copies_next.append((src, dst))
        self._blocks.add(dst)

    def step_starts(self) -> None:
        """The previous step ran: the copies it waited for are due in this one."""
        self._copies_due += self._copies_next
        self._copies_next = []

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) state copies for the worker to run before this step's forward
        pass."""
        due, self._copies_due = self._copies_due, []
        return due

    def forget(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` were handed out again: their state pages will be rewritten."""
        gone = set(block_ids)
        self._blocks -= gone
        self._copies_next = [c for c in self._copies_next if c[1] not in gone]
        self._copies_due = [c for c in self._copies_due if c[1] not in gone]

    def drop(self, block_id: int) -> list[int]:
        """``block_id``'s state page is gone (its pages were freed: ``StatePages``): it is no
        checkpoint, and no pending copy reads or writes it. Returns the destinations of
        the copies that would have read it, no longer checkpoints either."""
        self._blocks.discard(block_id)
        lost = []
        for copies in (self._copies_next, self._copies_due):
            lost += [dst for src, dst in copies if src == block_id]
            copies[:] = [c for c in copies if block_id not in c]
        self._blocks.difference_update(lost)
        return lost

    def clear(self) -> None:
        self._blocks.clear()
        self._copies_next.clear()
        self._copies_due.clear()

    def holds(self, block_id: int) -> bool:
        return block_id in self._blocks

    def longest_hit(self, full_block_ids: Sequence[int]) -> int:
        """Tokens of the longest prefix of ``full_block_ids`` (a match's full blocks)
        that ends on a recorded block; 0 if none."""
        for n in range(len(full_block_ids), 0, -1):
            if full_block_ids[n - 1] in self._blocks:
                return n * self.block_size
        return 0

    def check_invariants(self) -> None:
        bad = [b for b in self._blocks if not 0 < b < self.num_logical_blocks]
        if bad:
            raise AssertionError(f"checkpoints name invalid logical blocks {sorted(bad)}")
        unmarked = [d for _, d in self._copies_next + self._copies_due if d not in self._blocks]
        if unmarked:
            raise AssertionError(f"copy destinations {unmarked} are not recorded")
