"""Bad input gets a clear error and leaves the cache intact."""

import numpy as np
import pytest

from kvbackend.core import BlockPool, PrefixCache, TokenBuffer, as_token_array


@pytest.fixture
def cache():
    return PrefixCache(num_blocks=9, block_size=4)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([1, -2, 3], "non-negative|lie in"),
        ([1.5, 2.0], "integers"),
        (["a", "b"], "integers"),
        ([[1, 2], [3, 4]], "one-dimensional"),
        ([2**63], "lie in"),
        ([2**64], "integers"),
    ],
)
def test_bad_token_ids_are_refused(cache, tokens, message):
    with pytest.raises(ValueError, match=message):
        cache.match(tokens)
    with pytest.raises(ValueError, match=message):
        as_token_array(np.asarray(tokens))
    cache.check_invariants()


def test_out_of_range_block_ids_are_refused():
    pool = BlockPool(8)
    for bad in (0, 8, -1):  # 0 is the reserved null block
        with pytest.raises(ValueError, match="out of range"):
            pool.ref([bad], hold=False)
    pool.check_invariants()


def test_insert_with_too_few_blocks_is_refused(cache):
    with pytest.raises(ValueError, match="need 2 blocks"):
        cache.tree.insert([1, 2, 3, 4, 5], [1])


def test_double_release_is_refused(cache):
    seq = cache.open_sequence(cache.match([1, 2, 3]), 3)
    cache.release(seq)
    with pytest.raises(ValueError, match="already released"):
        cache.release(seq)
    with pytest.raises(ValueError, match="double release"):
        cache.pool.unref([1], hold=False)
    cache.check_invariants()


def test_unpin_of_something_never_pinned_is_refused(cache):
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin([1, 2, 3])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixCache(num_blocks=1, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(num_blocks=8, block_size=0)
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        PrefixCache(num_blocks=8, block_size=4, max_pinned_fraction=2.0)


def test_shrinking_a_sequence_or_caching_unwritten_tokens_is_refused(cache):
    seq = cache.open_sequence(cache.match([1, 2, 3]), 3)
    with pytest.raises(ValueError, match="shrink"):
        cache.extend(seq, 2)
    with pytest.raises(ValueError, match="cannot cache 4 tokens"):
        cache.cache(seq, [1, 2, 3, 4])


def test_token_buffer_appends_only_new_tokens_and_refuses_shrinking():
    buf = TokenBuffer(capacity=2)
    tokens = list(range(40))
    assert buf.sync(tokens[:3]).tolist() == [0, 1, 2]
    assert buf.sync(tokens).tolist() == tokens
    with pytest.raises(ValueError, match="shrank"):
        buf.sync(tokens[:5])


@pytest.mark.parametrize("seconds", [-1, float("inf"), float("nan"), "30", True])
def test_bad_retention_is_refused_and_the_sequence_stays_live(cache, seconds):
    uncached = cache.open_sequence(cache.match([9]), 1)
    with pytest.raises(ValueError, match="retention seconds must be a finite number"):
        cache.release(uncached, retain_s=seconds)
    assert not cache.release(uncached, retain_s=30)  # nothing cached: nothing to retain
    seq = cache.open_sequence(cache.match([1, 2, 3, 4, 5]), 5)
    cache.cache(seq, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="retention seconds must be a finite number"):
        cache.release(seq, retain_s=seconds)
    cache.check_invariants()
    assert cache.release(seq, retain_s=30)  # still live: released now, retained
    assert len(cache.tree.retentions) == 1
    cache.check_invariants()


def test_a_retention_larger_than_the_bound_is_not_made():
    cache = PrefixCache(num_blocks=9, block_size=4, max_retained_fraction=0.25)  # 2 blocks
    seq = cache.open_sequence(cache.match(list(range(12))), 12)
    cache.cache(seq, list(range(12)))
    assert not cache.release(seq, retain_s=30)
    assert len(cache.tree.retentions) == 0
    with pytest.raises(ValueError, match="max_retained_fraction"):
        PrefixCache(num_blocks=9, block_size=4, max_retained_fraction=1.5)
    cache.check_invariants()
