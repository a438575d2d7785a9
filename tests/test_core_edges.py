"""Edge cases of matching, copy-on-write, eviction order and retention."""

import pytest

from kvbackend.core import PrefixCache

BS = 4


def run(cache, tokens, namespace=None, priority=0):
    """Open, cache and release a sequence for ``tokens``; returns its hit length."""
    match = cache.match(tokens, namespace)
    seq = cache.open_sequence(match, len(tokens))
    assert seq is not None
    cache.take_block_copies()
    cache.complete_block_copies()
    cache.cache(seq, tokens, priority=priority)
    cache.release(seq)
    cache.check_invariants()
    return match.num_tokens


@pytest.fixture
def cache():
    return PrefixCache(num_blocks=17, block_size=BS)


def test_empty_prompt_matches_nothing_and_allocates_nothing(cache):
    match = cache.match([])
    assert (match.num_tokens, match.block_ids) == (0, ())
    seq = cache.open_sequence(match)
    assert seq.block_ids == [] and cache.pool.num_free == 16
    cache.release(seq)
    cache.check_invariants()


def test_prompt_shorter_than_a_block_is_reused_by_copy(cache):
    run(cache, [5, 6])
    match = cache.match([5, 6, 7])
    assert (match.num_tokens, match.num_full_blocks, match.num_partial_tokens) == (2, 0, 2)
    seq = cache.open_sequence(match, 3)
    (copy,) = cache.take_block_copies()
    assert (copy.src, copy.num_tokens) == (match.partial_block_id, 2)
    assert copy.dst == seq.block_ids[0] != copy.src


def test_exact_block_boundary_shares_without_copy(cache):
    run(cache, list(range(8)))
    match = cache.match(list(range(8)) + [99])
    assert match.num_tokens == 8 and match.num_partial_tokens == 0
    seq = cache.open_sequence(match, 9)
    assert cache.take_block_copies() == []
    assert seq.block_ids[:2] == list(match.block_ids)


def test_prefix_of_a_cached_prompt_and_the_reverse(cache):
    run(cache, list(range(10)))
    assert cache.match(list(range(6))).num_tokens == 6
    assert run(cache, list(range(6))) == 6
    assert run(cache, list(range(12))) == 10
    assert cache.match(list(range(12))).num_tokens == 12


def test_divergence_inside_a_block_gives_each_branch_its_own_block(cache):
    run(cache, [1, 2, 3, 4, 5, 6])
    run(cache, [1, 2, 3, 4, 5, 9, 9])
    a, b = cache.match([1, 2, 3, 4, 5, 6]), cache.match([1, 2, 3, 4, 5, 9, 9])
    assert a.block_ids[0] == b.block_ids[0] and a.block_ids[1] != b.block_ids[1]
    assert cache.match([1, 2, 3, 4, 5]).num_tokens == 5


def test_evicting_a_branch_inside_a_block_frees_its_block_and_keeps_the_other(cache):
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9]  # diverge inside block 1
    run(cache, a)
    run(cache, b)  # b used last: a is the LRU leaf, its block 1 shared with [4, 6)
    free = cache.pool.num_free
    assert cache.evict(1) == 1 and cache.pool.num_free == free + 1
    cache.check_invariants()
    assert cache.match(b).num_tokens == 8
    assert cache.match(a).num_tokens == 6  # served from b's copy of block 1
    cache.check_invariants()


def test_a_match_whose_partial_block_was_swapped_is_stale(cache):
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9]
    run(cache, a)
    run(cache, b)
    match = cache.match([1, 2, 3, 4, 5, 6, 0])  # ends inside block 1, in the shared node
    partial = match.partial_block_id
    run(cache, b)  # a stays the LRU leaf
    assert cache.evict(1) == 1 and cache.match([1, 2, 3, 4, 5, 6, 0]).partial_block_id != partial
    assert not cache.tree.is_current(match)
    with pytest.raises(ValueError, match="stale"):
        cache.open_sequence(match, 7)
    cache.check_invariants()


def test_pool_exhausted_returns_none_and_changes_nothing():
    cache = PrefixCache(num_blocks=4, block_size=BS)  # 3 usable blocks
    seq = cache.open_sequence(cache.match([1] * 8), 8)
    assert cache.open_sequence(cache.match([2] * 8), 8) is None
    assert cache.extend(seq, 13) is None and seq.num_tokens == 8
    assert cache.pool.num_free == 1
    cache.check_invariants()


def test_a_hit_inside_a_long_entry_can_evict_that_entry_s_unmatched_tail():
    """Opening locks only the matched prefix: the rest of the node the hit ends in stays
    evictable. (Locking the whole node left a waiting request unable to open although 8
    blocks were allocatable: on an idle engine, nothing else would ever free them.)"""
    cache = PrefixCache(num_blocks=9, block_size=BS)  # 8 usable blocks
    doc = list(range(100, 128))  # 28 tokens: one 7-block entry
    run(cache, doc)
    prompt = doc[:10] + list(range(200, 207))  # 17 tokens: 2 shared + 3 new blocks
    match = cache.match(prompt)
    assert match.num_tokens == 10 and cache.num_allocatable_blocks == 8
    seq = cache.open_sequence(match, len(prompt))
    assert seq is not None
    cache.check_invariants()
    cache.take_block_copies()
    cache.complete_block_copies()
    cache.cache(seq, prompt)
    cache.release(seq)
    cache.check_invariants()
    assert 10 <= cache.match(doc).num_tokens < len(doc)  # its tail was evicted, not its head


def test_a_locked_path_gives_up_the_block_a_continuation_copied():
    """A continuation of a prefix ending inside a block holds its own copy of that block,
    so the prefix's own copy is redundant; a request locking that path must not be
    refused for want of it. (It was: 8 blocks were needed of 9, the pool held 8 for the
    cached path, one of them unneeded; on an idle engine nothing would ever free it.)"""
    cache = PrefixCache(num_blocks=10, block_size=BS)  # 9 usable blocks
    prefix = list(range(100, 110))  # 10 tokens: ends inside block 2
    turn = prefix + list(range(200, 218))  # 28 tokens: hits 10, copies block 2
    assert (run(cache, prefix), run(cache, turn)) == (0, 10)
    assert cache.pool.num_free == 1  # 3 blocks of the prefix + 5 of the continuation
    longer = turn + list(range(300, 308))  # 36 tokens, 9 blocks: 7 shared, 2 new
    assert run(cache, longer) == 28
    assert cache.match(longer).num_tokens == 36 and cache.match(prefix).num_tokens == 10


def test_a_leaf_sharing_a_locked_parents_block_is_evicted_where_a_sibling_holds_a_copy():
    """A branch that shares its parent's partial block frees nothing by itself; with a
    sibling holding its own copy of that block, evicting it lets the parent take the
    sibling's copy, which frees the block even while the parent is locked."""
    cache = PrefixCache(num_blocks=10, block_size=BS)  # 9 usable blocks
    branch = [1, 2, 3, 4, 5, 6, 11, 12]  # 2 blocks
    turn = [1, 2, 3, 4, 5, 6] + list(range(200, 222))  # 28 tokens: hits 6, copies block 1
    assert (run(cache, branch), run(cache, turn)) == (0, 6)
    assert cache.pool.num_free == 1  # blocks 0-1 of the branch + 6 of the continuation
    longer = turn + list(range(300, 308))  # 36 tokens, 9 blocks: 7 shared, 2 new
    assert run(cache, longer) == 28
    assert cache.match(branch).num_tokens == 6  # its own tail was evicted


def test_evicting_a_branch_never_takes_an_evictable_copy_into_a_locked_path():
    """A locked path: prefix p ends inside block 1, its continuation x shares that block;
    branches y and z hold copies of it. Evicting y must not let p take z's copy (p's
    own stays held through x, so that frees nothing and holds z's block): a request
    needing every allocatable block then got none, and y was evicted for nothing."""
    cache = PrefixCache(num_blocks=10, block_size=BS)  # 9 usable blocks
    prefix = [1, 2, 3, 4, 5]
    x = cache.open_sequence(cache.match([]), 9)
    cache.cache(x, prefix + [6, 7, 8, 9])  # p + x: blocks 0-2, x keeps them locked
    assert run(cache, prefix + [20, 21, 22]) == 5  # y: a copy of block 1
    assert run(cache, prefix + [30, 31, 32]) == 5  # z: another copy
    assert cache.num_allocatable_blocks == 6  # 4 free, y's and z's copies
    other = cache.open_sequence(cache.match(list(range(40, 64))), 24)
    assert other is not None, "6 blocks were allocatable"
    cache.check_invariants()


def test_evicting_a_branch_never_takes_a_copy_into_a_locked_node_whose_own_stays_held(cache):
    """s's fork f holds the blocks (1, 2) of s's 8 tokens, which s cached and released;
    r locks their first 3 (splitting the entry inside block 1), and y cached a branch
    there with its own copy of that block. Evicting s's entry frees nothing (f holds its
    blocks): r's node must not then take y's copy (its own block stays held by f), or
    y's copy, the one evictable block, could not be freed."""
    tokens = list(range(100, 108))
    s = cache.open_sequence(cache.match([]), len(tokens))
    f = cache.fork(s)
    cache.cache(s, tokens)
    cache.release(s)
    r = cache.open_sequence(cache.match(tokens[:3]), 3)  # locks [0, 3)
    cache.take_block_copies()
    cache.complete_block_copies()
    assert run(cache, tokens[:3] + [99]) == 3  # y: its own copy of block 1
    assert cache.pool.num_evictable == 1
    assert cache.evict(2) == 1
    cache.check_invariants()
    for seq in (f, r):
        cache.release(seq)
    cache.check_invariants()


def test_a_grandchild_listing_the_block_counts_as_sharing_it(cache):
    """x caches 5 tokens, y continues them with a copy of block 1, then x caches its own
    continuation through y's node: x's leaf lists x's block 1, two levels below the node
    that ends in it. Dropping that node's copy leaves the leaf the block's only lister,
    and the locked (held) blocks stay counted exactly."""
    tokens = list(range(100, 113))
    x = cache.open_sequence(cache.match([]), len(tokens))
    cache.cache(x, tokens[:5])
    y_tokens = tokens[:6] + [7, 7, 7]
    y = cache.open_sequence(cache.match(y_tokens), len(y_tokens))
    cache.take_block_copies()
    cache.complete_block_copies()
    cache.cache(y, y_tokens)
    cache.cache(x, tokens)  # through y's node at position 5, then x's block 1 again
    reader = cache.open_sequence(cache.match(tokens), len(tokens))  # locks x's path
    cache.check_invariants()
    assert cache.drop_redundant_copies() == 0  # x's leaf still lists the block
    cache.check_invariants()
    for seq in (x, y, reader):
        cache.release(seq)
    cache.check_invariants()
    assert cache.match(tokens).num_tokens == len(tokens)
    assert cache.match(y_tokens).num_tokens == len(y_tokens)


def test_fork_shares_full_blocks_and_copies_the_partial_one(cache):
    seq = cache.open_sequence(cache.match(list(range(6))), 6)
    child = cache.fork(seq)
    assert child.block_ids[0] == seq.block_ids[0]
    assert child.block_ids[1] != seq.block_ids[1]
    assert cache.take_block_copies()[0].num_tokens == 2
    cache.complete_block_copies()
    cache.check_invariants()


def test_eviction_is_lru_and_leaves_first(cache):
    run(cache, [1, 1, 1, 1, 2, 2, 2, 2])  # shared prefix [1]*4 with suffix A
    run(cache, [1, 1, 1, 1, 3, 3, 3, 3])  # suffix B
    run(cache, [7, 7, 7, 7])  # C
    cache.match([1, 1, 1, 1, 2, 2, 2, 2])  # touch A: order of last use is B, C, A
    assert cache.evict(1) == 1
    assert cache.match([1, 1, 1, 1, 3, 3, 3, 3]).num_tokens == 4  # B's suffix, not the prefix
    assert cache.evict(1) == 1
    assert cache.match([7, 7, 7, 7]).num_tokens == 0
    assert cache.match([1, 1, 1, 1, 2, 2, 2, 2]).num_tokens == 8
    assert cache.evict(2) == 2  # A's suffix, then the prefix it shared
    assert cache.match([1, 1, 1, 1]).num_tokens == 0
    cache.check_invariants()


def test_a_partial_tail_block_goes_before_the_full_blocks_of_older_entries(cache):
    """A finished prompt's partial tail block holds a few tokens in a whole block: it goes
    before any full block of the same standing, whatever their last use (vLLM likewise
    reuses its unhashed blocks first). Under LRU alone these blocks crowded out full
    ones: bench_agents' resumed agents reused less than under vLLM's prefix caching."""
    run(cache, [1] * 8)  # two full blocks, least recently used
    run(cache, [2] * 9)  # two full blocks and a third holding one token
    assert cache.evict(1) == 1
    assert cache.match([1] * 8 + [5]).num_tokens == 8
    assert cache.match([2] * 9 + [5]).num_tokens == 8
    assert cache.evict(1) == 1  # now plain LRU among full blocks
    assert cache.match([1] * 8 + [5]).num_tokens == 4
    cache.check_invariants()


def test_priority_outlives_recency(cache):
    run(cache, [4] * 4, priority=5)
    run(cache, [8] * 4)
    cache.evict(1)
    assert cache.match([4] * 4).num_tokens == 4 and cache.match([8] * 4).num_tokens == 0


def test_pinned_prefix_survives_eviction_until_unpinned(cache):
    run(cache, [3] * 8)
    assert cache.pin([3] * 6)
    assert cache.evict(16) == 0  # the pinned path covers both blocks
    assert cache.match([3] * 8).num_tokens == 8
    cache.unpin([3] * 6)
    assert cache.evict(16) == 2
    cache.check_invariants()


def test_pin_refuses_uncached_prefixes_and_a_pool_sized_pin(cache):
    assert not cache.pin([9, 9])
    small = PrefixCache(num_blocks=9, block_size=BS, max_pinned_fraction=0.25)  # 2 blocks
    run(small, list(range(12)))
    assert not small.pin(list(range(12)))
    assert small.pin(list(range(8)))


def test_held_blocks_are_never_evicted(cache):
    seq = cache.open_sequence(cache.match([1] * 8), 8)
    cache.cache(seq, [1] * 8)
    assert cache.evict(16) == 0
    assert cache.match([1] * 8).num_tokens == 8
    cache.release(seq)
    assert cache.evict(16) == 2


def test_namespaces_never_share_entries(cache):
    run(cache, [1, 2, 3, 4], namespace="a")
    assert cache.match([1, 2, 3, 4], "b").num_tokens == 0
    assert cache.match([1, 2, 3, 4]).num_tokens == 0
    assert run(cache, [1, 2, 3, 4], namespace="b") == 0
    assert cache.tree.stats["a"].inserted_tokens == 4 == cache.tree.stats["b"].inserted_tokens


def test_stale_match_is_refused(cache):
    run(cache, [1] * 8)
    match = cache.match([1] * 8)
    cache.evict(16)
    with pytest.raises(ValueError, match="stale"):
        cache.open_sequence(match)


def test_stats_count_queries_hits_inserts_and_evictions(cache):
    run(cache, [1] * 8, namespace="t")
    cache.tree.record_query("t", 8, 6)
    cache.evict(2)
    stats = cache.tree.stats["t"]
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (1, 8, 6)
    assert (stats.inserted_tokens, stats.evicted_blocks) == (8, 2)


def test_64_bit_token_ids_are_cached_token_exactly(cache):
    image = 2**62 + 5  # SGLang's multimodal placeholder ids are 62-bit hashes
    run(cache, [1, image, image + 1, 2])
    assert cache.match([1, image, image + 1, 2, 3]).num_tokens == 4
    assert cache.match([1, image, image + 1 + 2**32]).num_tokens == 2  # differs in high bits only
    assert cache.match([1, image % 2**32]).num_tokens == 1
    cache.check_invariants()


def test_a_continuation_keeps_its_own_lower_priority(cache):
    """SGLang's rule: new tokens carry the inserting request's priority; a priority-0
    continuation of a priority-10 prompt goes before newer priority-0 entries."""
    run(cache, [4] * 4, priority=10)
    run(cache, [4] * 8, priority=0)  # the continuation: block 1
    run(cache, [8] * 4, priority=0)  # newer
    assert cache.evict(1) == 1
    assert cache.match([4] * 8).num_tokens == 4 and cache.match([8] * 4).num_tokens == 4
    assert cache.evict(1) == 1
    assert cache.match([4] * 4).num_tokens == 4 and cache.match([8] * 4).num_tokens == 0


def test_negative_priorities_are_kept(cache):
    run(cache, [4] * 4, priority=-3)
    run(cache, [8] * 4, priority=0)
    run(cache, [9] * 4, priority=-1)
    cache.match([4] * 4)  # most recently used, but the lowest priority
    assert cache.evict(1) == 1 and cache.match([4] * 4).num_tokens == 0
    assert cache.evict(1) == 1 and cache.match([9] * 4).num_tokens == 0
    assert cache.match([8] * 4).num_tokens == 4


def test_tree_pins_count_their_calls(cache):
    run(cache, [3] * 8)
    tree = cache.tree
    assert tree.pin([3] * 6) and tree.pin([3] * 6)
    tree.unpin([3] * 6)
    assert cache.evict(16) == 0  # still pinned once: the path covers both blocks
    tree.unpin([3] * 6)
    with pytest.raises(ValueError, match="not pinned"):
        tree.unpin([3] * 6)
    assert cache.evict(16) == 2
    cache.check_invariants()


def test_whole_leaf_eviction_drops_the_lru_leaf_entirely(cache):
    run(cache, [1] * 4 + [2] * 8)  # LRU: its leaf holds blocks 1 and 2
    run(cache, [1] * 4 + [3] * 8)
    assert cache.tree.evict(1, whole_leaves=True) == 2
    assert cache.match([1] * 4 + [2] * 8).num_tokens == 4
    assert cache.match([1] * 4 + [3] * 8).num_tokens == 12
    cache.check_invariants()


def test_a_copy_between_two_nodes_listing_one_block_keeps_the_held_count_exact(cache):
    """A sequence caches one token, its fork caches two into its own copy of block 0,
    then the first caches three: its node hangs under the fork's, inside the same block,
    and lists the block its grandparent lists. Held blocks count it once (the check
    refused this chain, and num_held_blocks counted 3 for 2 blocks)."""
    first = cache.open_sequence(cache.match([0, 0]), 2)
    fork = cache.fork(first)
    cache.take_block_copies()
    cache.complete_block_copies()
    cache.extend(first, 3)
    cache.cache(first, [0])
    cache.cache(fork, [0, 0])
    cache.cache(first, [0, 0, 0])
    assert cache.tree.num_held_blocks == 2
    cache.check_invariants()
    assert cache.match([0, 0, 0, 9]).block_ids == (first.block_ids[0],)


def test_retentions_sharing_a_prefix_count_it_once():
    cache = PrefixCache(num_blocks=17, block_size=BS, max_retained_fraction=0.5)  # 8 blocks
    system = list(range(100, 116))  # 4 blocks every agent shares

    def retain_agent(agent):
        tokens = system + [agent] * 8  # + 2 blocks of its own
        seq = cache.open_sequence(cache.match(tokens), len(tokens))
        cache.take_block_copies()
        cache.complete_block_copies()
        cache.cache(seq, tokens)
        retained = cache.release(seq, retain_s=30)
        cache.check_invariants()
        return retained

    assert retain_agent(1) and retain_agent(2)  # 4 + 2 + 2 distinct blocks: both fit
    assert cache.tree.num_retained_blocks == 8
    assert [r.node.path_tokens()[-1] for r in cache.tree.retentions] == [1, 2]
    assert retain_agent(3)  # 10 > 8: the oldest retention ends
    assert [r.node.path_tokens()[-1] for r in cache.tree.retentions] == [2, 3]
    assert cache.tree.num_retained_blocks == 8


def test_a_node_taking_its_childs_copy_keeps_retained_blocks_within_the_bound():
    """x's 8 tokens are retained: 2 blocks, the bound. y shares x's first 6, so the tree
    splits x's entry there (the node [0, 6) and its child [6, 8) both list block 1) and
    y's continuation copies block 1. Were the node to take y's copy, x's retained context
    would list 3 distinct blocks (block 0, the copy, and block 1 through the child):
    over the bound. It keeps its own (before: num_retained_blocks 3 > 2)."""
    cache = PrefixCache(num_blocks=11, block_size=BS, max_retained_fraction=0.2)
    x = list(range(1, 9))
    seq = cache.open_sequence(cache.match(x), len(x))
    cache.cache(seq, x)
    assert cache.release(seq, retain_s=10)
    y = x[:6] + [90, 91]
    assert run(cache, y) == 6
    cache.drop_redundant_copies()
    cache.check_invariants()
    assert cache.match(x).num_tokens == 8 and cache.match(y).num_tokens == 8


def test_eviction_reaches_a_parent_that_turns_into_a_leaf_before_a_skipped_one():
    """Tenant a's [0, 4) is split at 1 by a live request (its leaf [1, 4) shares the locked
    node's block: evicting it frees nothing). In the default namespace [0, 1) and [1, 4)
    share block 2, unlocked. Evicting [1, 4) frees nothing yet, and its parent, now a leaf
    with a partial tail, sorts before the skipped leaf: eviction went on past it by
    index and freed nothing (evict(1) returned 0 with one block evictable)."""
    cache = PrefixCache(num_blocks=24, block_size=BS, max_retained_fraction=0.3)

    def start(namespace, tokens):
        seq = cache.open_sequence(cache.match(tokens, namespace), len(tokens))
        cache.take_block_copies()
        cache.complete_block_copies()
        return seq

    a, b = start("a", [0, 0, 0, 0]), start(None, [0, 0, 0, 0])
    cache.cache(a, [0, 0, 0, 0])
    cache.release(a, retain_s=2)
    c, live = start(None, [0]), start("a", [0])
    cache.cache(b, [0, 0, 0, 0])
    cache.release(b, retain_s=2)
    cache.cache(c, [0])
    cache.release(c)
    assert cache.pool.num_evictable == 1
    assert cache.evict(1) == 1
    cache.check_invariants()
    assert cache.match([0, 0, 0, 0], "a").num_tokens == 4 and live.num_tokens == 1


def test_publishing_past_anothers_locked_prefix_does_not_grow_its_lock(cache):
    """a publishes 4 tokens and keeps running; b, opened before that, publishes the same
    4 and 8 more. The leaf a locks grew in place with b's tokens, so a held b's blocks
    until it ended (with a small pool, a could then wait forever for a block its own
    lock held). b's tokens hang below a's node now: a holds its one block."""
    tokens = list(range(1, 13))
    a = cache.open_sequence(cache.match(tokens[:4]), 8)
    b = cache.open_sequence(cache.match(tokens), 12)
    cache.cache(a, tokens[:4])
    cache.cache(b, tokens)
    cache.release(b)
    assert (a.node.start, a.node.end) == (0, 4)
    assert cache.tree.num_held_blocks == 1
    cache.check_invariants()


def test_a_sequence_short_of_blocks_gets_the_copies_its_own_path_holds_back():
    """b and c each copied the block of a's tokens 5-8 (block 2), below the node of
    tokens 1-6 that lists it. That node's swap to b's copy was refused while two nodes
    below listed block 2 (a's tail, split by c), and it stopped being a candidate. d
    continues b: locking its path held block 2 through that node, so the pool (5 blocks)
    could not supply d's 3 new ones although block 2 serves nothing d reads. A sequence
    short of blocks now makes the nodes on its own path take their continuations'
    copies; block 2 goes back with a's evicted tail."""
    cache = PrefixCache(num_blocks=6, block_size=BS)
    run(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    run(cache, [1, 2, 3, 4, 5, 6, 20, 21])
    run(cache, [1, 2, 3, 4, 5, 6, 7, 30])
    cache.drop_redundant_copies()
    match = cache.match([1, 2, 3, 4, 5, 6, 20, 21, 40])
    assert match.num_tokens == 8
    seq = cache.open_sequence(match, 20)
    assert seq is not None and len(seq.block_ids) == 5
    cache.check_invariants()
