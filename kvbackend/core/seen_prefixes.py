"""A bounded memory of the prefixes once cached: diagnostics only, never a hit.

When a request's prompt is not in the tree, "evicted" and "never seen" look the
same; these two structures tell them apart. ``PrefixDigests`` gives 64-bit
digests of one request's token prefixes ``tokens[:m]`` (keyed by its
namespace); ``SeenPrefixes`` remembers the digests of the prefixes published
to the tree, at every block boundary and at each published end. A prefix that
is remembered but no longer matches in the tree was evicted (or dropped by a
reset, which clears this memory too).

A digest is a sum, mod 2**64, of one splitmix64-mixed word per token (token id,
position and namespace seed mixed), so a prefix's digest extends in O(new
tokens), vectorized. Two different prefixes share a digest with probability
about 2**-64; a crafted collision is possible but can only mislabel a miss:
nothing here names a block, so a remembered digest can never cause a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def _mixed(tokens: np.ndarray, first_position: int, seed: np.uint64) -> np.ndarray:
    """One pseudo-random word per token, depending on its id, position and ``seed``.
    O(len(tokens)), vectorized (uint64 arithmetic wraps)."""
    positions = np.arange(first_position, first_position + len(tokens), dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = tokens.astype(np.uint64) ^ seed
        x += (positions + np.uint64(1)) * _GOLDEN
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return x


class PrefixDigests:
    """Digests of the prefixes of one append-only token sequence in one namespace.

    ``digest(tokens, m)`` is the digest of ``tokens[:m]``; ``boundaries`` holds those
    of ``tokens[:(i + 1) * block_size]`` hashed so far. The caller passes the same
    (growing) sequence every time. Memory: one int per block boundary hashed.
    Complexity: O(new tokens) per call, plus O(block_size) for a partial block.
    """

    __slots__ = ("block_size", "boundaries", "_seed", "_sum", "_hashed")

    def __init__(self, namespace: Hashable, block_size: int) -> None:
        self.block_size = block_size
        self.boundaries: list[int] = []
        self._seed = np.uint64(hash(namespace) & _MASK)
        self._sum = np.uint64(0)  # the digest of tokens[:_hashed]
        self._hashed = 0  # a multiple of block_size

    def extend(self, tokens: np.ndarray, num_tokens: int) -> None:
        """Hash the whole blocks of ``tokens[:num_tokens]`` not hashed yet."""
        end = num_tokens - num_tokens % self.block_size
        if end <= self._hashed:
            return
        with np.errstate(over="ignore"):
            sums = np.cumsum(_mixed(tokens[self._hashed:end], self._hashed, self._seed),
                             dtype=np.uint64) + self._sum
        self.boundaries.extend(sums[self.block_size - 1::self.block_size].tolist())
        self._sum, self._hashed = sums[-1], end

    def digest(self, tokens: np.ndarray, num_tokens: int) -> int:
        """The digest of ``tokens[:num_tokens]`` (``num_tokens`` >= 1)."""
        self.extend(tokens, num_tokens)
        start = num_tokens - num_tokens % self.block_size
        base = self.boundaries[start // self.block_size - 1] if start else 0
        if start == num_tokens:
            return base
        with np.errstate(over="ignore"):
            tail = _mixed(tokens[start:num_tokens], start, self._seed).sum(dtype=np.uint64)
        return (base + int(tail)) & _MASK


class SeenPrefixes:
    """The digests of at most ``capacity`` prefixes, least recently published first out.

    Memory: one ``OrderedDict`` entry (~124 bytes, measured) per digest, at most ``capacity``;
    ``add`` and ``__contains__`` are O(1). A re-published prefix moves to the back,
    so prefixes that keep being used are the last forgotten.

    Invariants (``check_invariants``): ``len(self) <= capacity``; every key is an
    int in [0, 2**64).
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._digests: OrderedDict[int, None] = OrderedDict()

    def add(self, digest: int) -> None:
        digests = self._digests
        if digest in digests:
            digests.move_to_end(digest)
            return
        digests[digest] = None
        if len(digests) > self.capacity:
            digests.popitem(last=False)

    def __contains__(self, digest: int) -> bool:
        return digest in self._digests

    def __len__(self) -> int:
        return len(self._digests)

    def clear(self) -> None:
        self._digests.clear()

    def check_invariants(self) -> None:
        """Assert the invariants in the class docstring. O(len)."""
        if len(self._digests) > self.capacity:
            raise RuntimeError(f"{len(self._digests)} digests exceed capacity {self.capacity}")
        bad = [d for d in self._digests if not (isinstance(d, int) and 0 <= d < 1 << 64)]
        if bad:
            raise RuntimeError(f"digests that are not 64-bit ints: {bad[:4]}")
