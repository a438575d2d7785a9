"""The token-array kernels against brute force (tests/token_reference.py)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvbackend.core import as_token_array, cdiv, common_prefix_length
from tests.store_helpers import run_python
from tests.token_reference import lcp

TOKEN = st.sampled_from([0, 1, 2**62 + 7])


@given(data=st.data(), shared=st.integers(0, 700), tails=st.tuples(
    st.lists(TOKEN, max_size=40), st.lists(TOKEN, max_size=40)))
def test_common_prefix_length_is_the_brute_force_lcp(data, shared, tails):
    """Lengths around and beyond the 128-token chunks the kernel compares at once."""
    stem = np.arange(shared) % 3
    a = as_token_array(np.concatenate([stem, tails[0]]).astype(np.int64))
    b = as_token_array(np.concatenate([stem, tails[1]]).astype(np.int64))
    start = data.draw(st.integers(0, min(len(a), len(b))))
    assert common_prefix_length(a, start, b, start) == lcp(a[start:].tolist(),
                                                           b[start:].tolist())
    assert common_prefix_length(a, 0, b, 0) == lcp(a.tolist(), b.tolist())


@given(a=st.integers(0, 2**62), b=st.integers(1, 2**20))
def test_cdiv_is_the_least_count_of_b_sized_blocks_holding_a(a, b):
    q = cdiv(a, b)
    assert q * b >= a > (q - 1) * b or a == q == 0


def test_a_new_tree_loads_the_compiled_loops_before_its_first_lookup():
    """Loading them takes 0.2 s or more once per process: an engine's start pays it (its
    tree is made then), not its first request's scheduling step. In a fresh process,
    so that nothing here loaded them before."""
    result = run_python(
        "from kvbackend.core import token_ops\n"
        "from kvbackend.core.block_pool import BlockPool\n"
        "from kvbackend.core.radix_tree import RadixTree\n"
        "assert not token_ops._common_prefix_length.signatures\n"
        "RadixTree(4, BlockPool(8))\n"
        "import numba, numpy as np\n"
        "tokens = numba.typeof(np.arange(3, dtype=token_ops.TOKEN_DTYPE))\n"
        "print(any(sig[0] == sig[2] == tokens\n"
        "          for sig in token_ops._common_prefix_length.signatures))\n", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"  # for the token arrays every lookup compares
