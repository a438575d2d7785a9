"""The live retentions of a radix tree: time-bounded hints that keep a context cached.

A retention names the deepest node of a finished request's context (prompt and
output); until its expiry time that node and every ancestor are evicted only after
every ordinary unlocked leaf (``RadixTree.retain``). This module keeps the book:
the tree owns the nodes, their ``retain_count`` and the bound on the distinct
blocks they list (a prefix shared by several retentions counts once).

Invariants (checked by ``check_invariants``; the tree checks the node side):
    * the live retentions are in creation order (oldest first)
    * every live retention has an entry ``(until, retention_id)`` in the expiry heap
      (the heap may also hold entries of retentions that ended early)
    * the end index lists exactly the live retentions, under their current node
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvbackend.core.radix_node import RadixNode


@dataclass(eq=False, slots=True)
class Retention:
    """Keep the path to ``node`` ahead of ordinary entries until ``until`` (clock seconds)."""

    retention_id: int
    node: RadixNode
    until: float


class RetentionBook:
    """Live retentions by age, by expiry (a lazy heap) and by end node.

    ``add``, ``remove``, ``oldest`` and ``move_end`` are O(log n) or better (amortized);
    ``expired`` pops each heap entry once.
    """

    def __init__(self) -> None:
        self._live: OrderedDict[int, Retention] = OrderedDict()  # oldest first
        self._expiry: list[tuple[float, int]] = []  # heap of (until, retention_id)
        self._ends: dict[int, list[Retention]] = {}  # node_id -> retentions ending there
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Retention]:
        return iter(list(self._live.values()))

    def add(self, node: RadixNode, until: float) -> Retention:
        retention = Retention(next(self._ids), node, until)
        self._live[retention.retention_id] = retention
        heapq.heappush(self._expiry, (until, retention.retention_id))
        self._ends.setdefault(node.node_id, []).append(retention)
        return retention

    def remove(self, retention: Retention) -> None:
        del self._live[retention.retention_id]
        self._unindex(retention)
        if len(self._expiry) > 2 * len(self._live) + 16:  # drop entries of early ends
            self._expiry = [(r.until, r.retention_id) for r in self._live.values()]
            heapq.heapify(self._expiry)

    def oldest(self) -> Retention | None:
        return next(iter(self._live.values()), None)

    def ending_at(self, node: RadixNode) -> list[Retention]:
        return list(self._ends.get(node.node_id, ()))

    def move_end(self, node: RadixNode, parent: RadixNode) -> list[Retention]:
        """Re-point the retentions ending at ``node`` (leaving the tree) to ``parent``;
        returns them."""
        moved = self._ends.pop(node.node_id, [])
        for retention in moved:
            retention.node = parent
        if moved:
            self._ends.setdefault(parent.node_id, []).extend(moved)
        return moved

    def expired(self, now: float) -> list[Retention]:
        """The live retentions whose time is up (``until <= now``), oldest expiry first;
        pops their heap entries (the caller removes them)."""
        due = []
        while self._expiry and self._expiry[0][0] <= now:
            _, retention_id = heapq.heappop(self._expiry)
            retention = self._live.get(retention_id)
            if retention is not None:
                due.append(retention)
        return due

    def _unindex(self, retention: Retention) -> None:
        key = retention.node.node_id
        ending = self._ends[key]
        ending.remove(retention)
        if not ending:
            del self._ends[key]

    def check_invariants(self) -> None:
        """Assert every invariant in the module docstring. O(n log n)."""
        ids = list(self._live)
        if ids != sorted(ids):
            raise RuntimeError("live retentions are out of creation order")
        if not {(r.until, i) for i, r in self._live.items()} <= set(self._expiry):
            raise RuntimeError("a live retention has no expiry entry")
        indexed = {(key, r.retention_id) for key, rs in self._ends.items() for r in rs}
        if indexed != {(r.node.node_id, i) for i, r in self._live.items()}:
            raise RuntimeError("the end index disagrees with the live retentions")
