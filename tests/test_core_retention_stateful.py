"""Stateful property test of retention (``release(retain_s=...)``) mixed with pins,
priorities, locks and a controllable clock.

It runs every rule of the prefix-cache machine (fake KV, brute-force residency,
held and pinned prefixes never evicted) on a cache with a bounded retained share,
and adds a model of the live retentions: their order (oldest first), expiry,
the share cap on *distinct* retained blocks (recounted by brute force from the
tree's nodes: a prefix several retentions share counts once), ending the
retentions on a new one's path, and trimming by eviction.
Before each single-block eviction it ranks the unlocked leaves by brute force --
(retained by the model, priority, a partial tail block first, last use) -- and checks
that the tree took blocks from the lowest-ranked leaves only: every ordinary leaf
before any retained one, and an expired retention exactly like an ordinary entry.
"""

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import tests.test_core_stateful as base
from kvbackend.core import PrefixCache

BLOCK_SIZE = base.BLOCK_SIZE
MAX_RETAINED_FRACTION = 0.3  # 6 of the 23 usable blocks: some contexts do not fit at all
RETAIN_S = st.sampled_from([0, 2, 5, 10])


class RetentionMachine(base.PrefixCacheMachine):
    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.cache = PrefixCache(base.NUM_BLOCKS, BLOCK_SIZE,
                                 max_retained_fraction=MAX_RETAINED_FRACTION,
                                 clock=lambda: self.now)
        self.max_retained = int(MAX_RETAINED_FRACTION * (base.NUM_BLOCKS - 1))
        self.retained = []  # oldest first: [namespace, tokens, until]

    # ------------------------------------------------------------- model
    def live_retentions(self):
        return [r for r in self.retained if r[2] > self.now]

    def is_retained(self, node):
        path = tuple(node.path_tokens().tolist())
        return any(ns == node.namespace and toks[: len(path)] == path
                   for ns, toks, _ in self.live_retentions())

    def retained_blocks(self, contexts):
        """The distinct block ids the tree's nodes list for positions inside any of
        ``contexts`` ((namespace, tokens) pairs), by brute force."""
        blocks = set()
        for node in self.cache.tree.iter_nodes(all_namespaces=True):
            path = tuple(node.path_tokens().tolist())
            for ns, toks in contexts:
                covered = min(len(toks), node.end)
                if ns == node.namespace and node.start < covered \
                        and toks[:covered] == path[:covered]:
                    blocks.update(node.block_ids[: (covered - 1) // BLOCK_SIZE
                                                 - node.start // BLOCK_SIZE + 1].tolist())
        return blocks

    def model_retain(self, ns, tokens, seconds):
        """What ``release(retain_s=seconds)`` must do to the retentions; whether it retains."""
        if not seconds or not tokens or \
                len(self.retained_blocks([(ns, tokens)])) > self.max_retained:
            return False
        self.retained = self.live_retentions()
        until = self.now + seconds
        self.retained = [r for r in self.retained if not (
            r[0] == ns and tokens[: len(r[1])] == r[1] and r[2] <= until)]
        while len(self.retained_blocks([(r[0], r[1]) for r in self.retained]
                                       + [(ns, tokens)])) > self.max_retained:
            self.retained.pop(0)
        self.retained.append([ns, tokens, until])
        return True

    def reconcile(self, inserted=None, may_evict=True):
        super().reconcile(inserted, may_evict)
        for r in self.retained:  # eviction trims a retention to what stays cached
            r[1] = r[1][: self.expected_hit(r[0], r[1])]
        self.retained = [r for r in self.live_retentions() if r[1]]
        tree_retentions = sorted(
            (repr(r.node.namespace), tuple(r.node.path_tokens().tolist()), r.until)
            for r in self.cache.tree.retentions if r.until > self.now)
        assert tree_retentions == sorted((repr(ns), toks, until)
                                         for ns, toks, until in self.retained)
        distinct = self.retained_blocks([(ns, toks) for ns, toks, _ in self.retained])
        assert len(distinct) <= self.max_retained

    def eviction_candidates(self):
        """Unlocked leaves that would free a block, by brute-force rank."""
        ranked = []
        for node in self.cache.tree.iter_nodes(all_namespaces=True):
            if node.children or node.lock_ref:
                continue
            parent = node.parent
            if (len(node.block_ids) == 1 and node.start % BLOCK_SIZE and parent.lock_ref
                    and parent.block_ids[-1] == node.block_ids[0]):
                continue  # its only block is its locked parent's
            rank = (self.is_retained(node), node.priority, node.end % BLOCK_SIZE == 0,
                    node.last_access, node.node_id)
            ranked.append((rank, node, len(node.tokens)))
        return sorted(ranked, key=lambda entry: entry[0])

    # ------------------------------------------------------------- rules
    @precondition(lambda self: self.live)
    @rule(data=st.data(), seconds=RETAIN_S, priority=st.integers(-1, 1))
    def release(self, data, seconds, priority):
        """A request ends, like in vLLM's ``free``: all its tokens are cached first."""
        entry = data.draw(st.sampled_from(self.live))
        seq, tokens = entry
        self.cache.cache(seq, tokens, priority=priority)
        self.reconcile(inserted=(seq.namespace, tokens), may_evict=False)
        self.live.remove(entry)
        context = tuple(tokens[: seq.num_locked_tokens])
        expected = self.model_retain(seq.namespace, context, seconds)
        assert self.cache.release(seq, retain_s=seconds) == expected
        self.reconcile(may_evict=False)

    @rule(seconds=st.sampled_from([0.5, 1, 3]))
    def advance_clock(self, seconds):
        self.now += seconds

    @precondition(lambda self: self.retained)  # plain eviction order: the base machine
    @rule()
    def evict_one_block_in_order(self):
        self.retained = self.live_retentions()  # the tree expires retentions first
        ranked = self.eviction_candidates()
        self.cache.evict(1)
        touched = [i for i, (_, node, length) in enumerate(ranked)
                   if not self.cache.tree.is_attached(node) or len(node.tokens) < length]
        assert bool(touched) == bool(ranked), "eviction skipped every candidate or took none"
        if touched:  # a contiguous run of the lowest ranks, from the first
            assert touched == list(range(len(touched))), \
                f"evicted ranks {touched} of {[r for r, _, _ in ranked]}"
        self.reconcile()


TestRetentionMachine = RetentionMachine.TestCase
