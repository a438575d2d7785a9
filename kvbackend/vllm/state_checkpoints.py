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
admits it only once the step writing that checkpoint has run).

Invariants (``check_invariants``): every recorded block id is a valid logical
id other than the null block 0; a block handed out again (newly allocated to a
request) is no longer recorded (``forget``), so a record always names the step
that wrote the block's current state page.
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

    def step_ended(self, block_ids: Sequence[int], end: int) -> None:
        """A step of the request with block table ``block_ids`` ended after token
        ``end``; on a block boundary its last block now holds a checkpoint."""
        if end > 0 and end % self.block_size == 0:
            self._blocks.add(block_ids[end // self.block_size - 1])

    def forget(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` were handed out again: their state pages will be rewritten."""
        self._blocks.difference_update(block_ids)

    def clear(self) -> None:
        self._blocks.clear()

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
