"""``shared_prefix_order`` against its definition, on random trees and requests."""

from hypothesis import given
from hypothesis import strategies as st

from kvbackend.core import RadixTree
from kvbackend.core.prefix_order import shared_prefix_order

PROMPTS = st.lists(st.tuples(st.sampled_from([None, "a"]),
                             st.lists(st.integers(0, 2), min_size=1, max_size=8)),
                   min_size=1, max_size=12)


class _Blocks:
    """Block ids are irrelevant to the order: every block is always available."""

    def ref(self, ids, *, hold): pass
    def unref(self, ids, *, hold): return len(ids)
    def hold(self, ids): pass
    def unhold(self, ids): pass


def _on_path(node, ancestor) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


@given(prompts=PROMPTS, data=st.data())
def test_order_is_depth_first_heaviest_subtree_first(prompts, data):
    tree = RadixTree(2, _Blocks())
    for namespace, tokens in prompts:
        tree.insert(tokens, list(range(len(tokens))), namespace)
    nodes = list(tree.iter_nodes(all_namespaces=True))
    handles = data.draw(st.lists(st.sampled_from(nodes + [None]), max_size=10))
    order = shared_prefix_order(handles, tree.roots.values())
    assert sorted(order) == list(range(len(handles)))
    position = {index: pos for pos, index in enumerate(order)}
    uncached = [position[i] for i, h in enumerate(handles) if h is None]
    assert uncached == list(range(len(order) - len(uncached), len(order)))

    def below(node) -> list[int]:  # positions of the requests in node's subtree
        return sorted(position[i] for i, h in enumerate(handles)
                      if h is not None and _on_path(h, node))

    for node in nodes + list(tree.roots.values()):
        inside = below(node)
        assert inside == list(range(inside[0], inside[0] + len(inside))) if inside else True
        own = [position[i] for i, h in enumerate(handles) if h is node]
        assert all(p > q for p in own for q in inside if q not in own)  # subtree first
        siblings = [below(c) for c in node.children.values()]
        for a, first in enumerate(siblings):
            for second in siblings[a + 1:]:
                if first and second:  # the heavier first; ties keep the tree's order
                    assert (first[0] < second[0]) == (len(first) >= len(second))
