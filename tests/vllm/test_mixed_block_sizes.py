"""kvbackend serving KV-cache groups of different block sizes: a tiny Gemma 4, whose
full-attention layer holds twice the KV bytes per token of its sliding-window layer, so
vLLM gives the sliding-window group 64-token blocks and the full-attention group 32-token
ones (the scheduler's block: 64 tokens).

kvbackend's logical block is then one sliding-window block and two full-attention
blocks (``BlockGroups``): a block table that misplaced either would change the greedy
outputs. Engines as in ``test_sliding_window.py``: kvbackend, vLLM without prefix
caching (the ground truth) and vLLM's own prefix caching (the hit baseline).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams

from kvbackend.testing.tiny_model import build_tiny_gemma4
from kvbackend.vllm.block_groups import BlockGroups
from tests.vllm.conftest import generate, make_engine, shutdown
from tests.vllm.conftest import random_tokens as tokens
from tests.vllm.test_sliding_window import check_shared_prefix_rounds

ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=4 << 20)  # 42 logical blocks


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return build_tiny_gemma4(str(tmp_path_factory.mktemp("tiny-gemma4")))


@pytest.fixture(scope="module")
def engines(gemma4) -> dict:
    """kvbackend, vLLM without prefix caching and vLLM's prefix caching, by mode."""
    llms = {}
    try:
        for mode in ("kvbackend", "no-cache", "vllm-apc"):
            llms[mode] = make_engine(gemma4, mode, **ENGINE)
        yield llms
    finally:
        for llm in llms.values():
            shutdown(llm)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 80),
       st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), max_size=4))
def test_block_groups_give_each_group_its_blocks_in_table_order(pages, num_physical, pairs):
    groups = BlockGroups(num_physical, pages)
    groups.check_invariants()
    pairs = [(s, d) for s, d in pairs if max(s, d) < groups.num_logical]
    copies = [(c.src_block_id, c.dst_block_id) for c in groups.copies(pairs)]
    assert copies == [(s * groups.stride + j, d * groups.stride + j)
                      for s, d in pairs for j in range(sum(pages))]


def test_shared_prefixes_partial_blocks_and_branches_match_vllm(engines):
    check_shared_prefix_rounds(engines["kvbackend"], engines["no-cache"], engines["vllm-apc"])


def test_memory_pressure_keeps_outputs_exact(engines):
    """Twelve 500-token requests sharing 200 tokens need 96 logical blocks, the pool holds
    42 (every group's blocks for the whole context): cached blocks are evicted and their
    three physical blocks reused while other requests share the prefix, twice."""
    kvb, ref = engines["kvbackend"], engines["no-cache"]
    assert kvb.reset_prefix_cache()
    rng = random.Random(5)
    shared = tokens(rng, 200)
    prompts = [shared + tokens(rng, 300) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24)
    for _ in range(2):
        got, want = generate(kvb, prompts, params), generate(ref, prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.num_cached_tokens >= len(shared) for o in got) > 0
