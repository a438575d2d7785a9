"""Stateful property test of the prefix cache against a brute-force model.

The model keeps the set of resident cached prefixes per namespace and a fake KV
tensor in which slot (block, offset) holds the whole token prefix that produced
it -- so reading a block written for another prefix, or a copy-on-write gone
wrong, shows up as a wrong slot value.
"""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.core import PrefixCache

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NAMESPACES = st.sampled_from([None, "tenant-a", ("lora", 7)])
# Three distinct ids so prompts share prefixes often; one above 2**32 (SGLang's
# multimodal placeholders are 62-bit hashes).
TOKEN = st.sampled_from([0, 1, 2**62 + 7])
TOKENS = st.lists(TOKEN, min_size=0, max_size=18)


def prefixes(tokens):
    return {tuple(tokens[:i]) for i in range(1, len(tokens) + 1)}


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = PrefixCache(NUM_BLOCKS, BLOCK_SIZE)
        self.kv = {}  # (block, offset) -> token prefix whose KV the slot holds
        self.resident = {}  # namespace -> set of cached prefixes (tuples)
        self.live = []  # [sequence, tokens]
        self.pins = set()  # (namespace, tokens)

    # ------------------------------------------------------------- helpers
    def slot(self, block_ids, pos):
        return self.kv.get((block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE))

    def write(self, seq, tokens, start):
        assert 0 not in seq.block_ids, "the null block was handed out"
        for p in range(start, len(tokens)):
            self.kv[(seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE)] = tuple(tokens[: p + 1])

    def run_copies(self):
        for copy in self.cache.take_block_copies():
            for off in range(copy.num_tokens):
                self.kv[(copy.dst, off)] = self.kv[(copy.src, off)]
        self.cache.complete_block_copies()

    def expected_hit(self, ns, tokens):
        cached = self.resident.get(ns, set())
        return max((i for i in range(1, len(tokens) + 1) if tuple(tokens[:i]) in cached), default=0)

    def tree_resident(self):
        out = {}
        for ns in self.cache.tree.namespaces():
            out[ns] = set()
            for node in self.cache.tree.iter_nodes(ns):
                out[ns] |= prefixes(list(node.path_tokens()))
        return out

    def reconcile(self, inserted=None, may_evict=True):
        """The tree only loses what eviction may take; the model follows it."""
        now = self.tree_resident()
        allowed = {ns: set(s) for ns, s in self.resident.items()}
        if inserted:
            allowed.setdefault(inserted[0], set()).update(prefixes(inserted[1]))
        for ns, cached in now.items():
            assert cached <= allowed.get(ns, set()), \
                f"cached tokens that were never inserted in {ns!r}"
        if not may_evict:
            assert {k: v for k, v in now.items() if v} == {k: v for k, v in allowed.items() if v}
        for seq, tokens in self.live:
            if seq.num_locked_tokens:
                assert tuple(tokens[: seq.num_locked_tokens]) in now.get(seq.namespace, ()), \
                    "evicted a prefix a live sequence holds"
        for ns, toks in self.pins:
            assert toks in now.get(ns, ()), "evicted a pinned prefix"
        self.resident = now

    # --------------------------------------------------------------- rules
    @rule(data=st.data(), ns=NAMESPACES)
    def open_sequence(self, data, ns):
        live = [tokens for seq, tokens in self.live if seq.namespace == ns]
        tokens = data.draw(TOKENS | st.sampled_from(live) if live else TOKENS,
                           label="tokens (a live sequence's too)")
        # A hit cut back (the manager's, to where sliding windows have their pages): the
        # sequence recomputes tokens the tree lists under other blocks.
        cap = data.draw(st.none() | st.integers(0, len(tokens)), label="hit cut back to")
        match = self.cache.match(tokens, ns, max_tokens=cap)
        assert match.num_tokens == min(self.expected_hit(ns, tokens), len(tokens) if cap is None
                                       else cap)
        assert len(match.block_ids) == -(-match.num_tokens // BLOCK_SIZE)
        for p in range(match.num_tokens):
            assert self.slot(match.block_ids, p) == tuple(tokens[: p + 1]), "wrong KV for a hit"
        need = -(-len(tokens) // BLOCK_SIZE) - match.num_full_blocks
        # Opening locks the matched prefix only: its evictable blocks stop being
        # allocatable, the rest of a node it ends inside does not.
        pool = self.cache.pool
        allocatable = self.cache.num_allocatable_blocks - sum(
            1 for b in set(match.block_ids) if pool.hold_cnt[b] == 0)
        seq = self.cache.open_sequence(match, len(tokens))
        if seq is None:
            assert need > allocatable
            self.reconcile(may_evict=False)
            return
        self.run_copies()
        self.write(seq, tokens, match.num_tokens)
        self.live.append([seq, list(tokens)])
        self.reconcile()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(TOKEN, min_size=1, max_size=9))
    def append_tokens(self, data, new):
        entry = data.draw(st.sampled_from(self.live))
        seq, tokens = entry
        computed = len(tokens)
        if self.cache.extend(seq, computed + len(new)) is None:
            self.reconcile(may_evict=False)
            return
        entry[1] = tokens + new
        self.write(seq, entry[1], computed)
        self.reconcile()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), priority=st.integers(-2, 2))
    def cache_tokens(self, data, priority):
        seq, tokens = data.draw(st.sampled_from(self.live))
        cut = data.draw(st.integers(0, len(tokens)))
        self.cache.cache(seq, tokens[:cut], priority=priority)
        self.reconcile(inserted=(seq.namespace, tokens[:cut]), may_evict=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        entry = data.draw(st.sampled_from(self.live))
        self.live.remove(entry)
        self.cache.release(entry[0])
        self.reconcile(may_evict=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        seq, tokens = data.draw(st.sampled_from(self.live))
        child = self.cache.fork(seq)
        if child is None:
            assert seq.num_tokens % BLOCK_SIZE and self.cache.num_allocatable_blocks == 0
        else:
            self.run_copies()
            self.live.append([child, list(tokens)])
        self.reconcile()

    @rule(k=st.integers(0, NUM_BLOCKS))
    def evict(self, k):
        evictable = self.cache.pool.num_evictable
        freed = self.cache.evict(k)
        assert freed >= min(k, evictable)
        self.reconcile()

    @rule(data=st.data())
    def recompute_and_replace(self, data):
        """A sequence recomputes cached tokens (its hit was cut back), then its blocks
        take the place of those the tree lists for a prefix of them (the manager's
        ``_adopt_window_pages``): every slot still holds its prefix, no cached token goes."""
        cached = sorted(((ns, toks) for ns, prefixes_ in self.resident.items()
                         for toks in prefixes_ if len(toks) >= BLOCK_SIZE), key=repr)
        if not cached:
            return
        ns, tokens = data.draw(st.sampled_from(cached), label="cached prefix")
        tokens = list(tokens) + data.draw(st.lists(TOKEN, max_size=5), label="more tokens")
        cap = data.draw(st.integers(0, (len(tokens) - 1) // BLOCK_SIZE).map(
            lambda b: b * BLOCK_SIZE) | st.integers(0, len(tokens) - 1), label="hit cut back to")
        match = self.cache.match(tokens, ns, max_tokens=cap)
        seq = self.cache.open_sequence(match, len(tokens))
        if seq is None:
            self.reconcile(may_evict=False)
            return
        self.run_copies()
        self.write(seq, tokens, match.num_tokens)
        self.live.append([seq, tokens])
        self.reconcile()
        cut = data.draw(st.integers(0, len(tokens)), label="prefix")
        taken = data.draw(st.just(set(range(NUM_BLOCKS))) | st.sets(st.integers(1, NUM_BLOCKS - 1)),
                          label="blocks replaced")
        swapped = self.cache.replace_blocks(seq, tokens[:cut], lambda old, new: old in taken)
        assert all(old in taken and new in seq.block_ids for old, new in swapped)
        self.reconcile(may_evict=False)

    @rule()
    def drop_redundant_copies(self):
        """Nodes take their children's copies of the block they end inside: every slot
        they list still holds its prefix, and no cached token goes."""
        self.cache.tree.drop_redundant_copies()
        self.reconcile(may_evict=False)

    @rule(data=st.data(), ns=NAMESPACES)
    def pin(self, data, ns):
        cached = sorted(self.resident.get(ns, ()))
        if not cached:
            return
        toks = data.draw(st.sampled_from(cached))
        if self.cache.pin(list(toks), ns):
            self.pins.add((ns, toks))
        self.reconcile(may_evict=False)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        ns, toks = data.draw(st.sampled_from(sorted(self.pins, key=repr)))
        self.cache.unpin(list(toks), ns)
        self.pins.discard((ns, toks))
        self.reconcile(may_evict=False)

    # ---------------------------------------------------------- invariants
    @invariant()
    def structure_is_consistent(self):
        self.cache.check_invariants()

    @invariant()
    def every_cached_and_live_slot_holds_its_prefix(self):
        for node in self.cache.tree.iter_nodes(all_namespaces=True):
            path = list(node.path_tokens())
            first = node.start // BLOCK_SIZE
            for p in range(node.start, node.end):
                block = node.block_ids[p // BLOCK_SIZE - first]
                assert self.kv.get((block, p % BLOCK_SIZE)) == tuple(path[: p + 1])
        for seq, tokens in self.live:
            for p in range(len(tokens)):
                assert self.slot(seq.block_ids, p) == tuple(tokens[: p + 1])

    @invariant()
    def pool_accounting_adds_up(self):
        pool = self.cache.pool
        assert pool.num_free + pool.num_evictable + pool.num_held == NUM_BLOCKS - 1


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
