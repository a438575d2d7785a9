"""A scheduling order that keeps requests sharing a cached prefix together.

Each waiting request is represented by the tree node its cached prefix ends at
(``None``: nothing cached). ``shared_prefix_order`` lists the requests depth-first
over the tree: a node's subtree is visited before the node's own requests, the
subtree holding more requests first (ties: the children's order in the tree),
and the namespaces' roots likewise, in ``roots`` order on ties; requests with
nothing cached come last. So every subtree's requests are contiguous, and a
prefix shared by many requests is served while its blocks are hot (SGLang's
``dfs-weight`` schedule policy).

Complexity: O(r * depth) for r requests, plus the children of the nodes on
their paths (only subtrees holding a request are entered).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvbackend.core.radix_node import RadixNode


def shared_prefix_order(nodes: Sequence[RadixNode | None],
                        roots: Iterable[RadixNode]) -> list[int]:
    """The indices of ``nodes`` in the order above; ``roots``: the tree's roots, in order."""
    weight: dict[int, int] = {}  # id(node) -> requests ending at or below it
    ending: dict[int, list[int]] = {}  # id(node) -> indices of requests ending at it
    path_roots: dict[int, RadixNode] = {}
    uncached: list[int] = []
    for index, node in enumerate(nodes):
        if node is None:
            uncached.append(index)
            continue
        ending.setdefault(id(node), []).append(index)
        while True:
            weight[id(node)] = weight.get(id(node), 0) + 1
            if node.is_root:
                path_roots.setdefault(id(node), node)
                break
            node = node.parent
    rank = {id(root): i for i, root in enumerate(roots)}
    top = sorted(path_roots.values(), key=lambda r: (-weight[id(r)], rank.get(id(r), len(rank))))
    order: list[int] = []
    stack: list[tuple[RadixNode, bool]] = [(root, False) for root in reversed(top)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.extend(ending.get(id(node), ()))
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if id(c) in weight]
        children.sort(key=lambda c: -weight[id(c)])  # stable: the tree's order on ties
        stack.extend((child, False) for child in reversed(children))
    return order + uncached
