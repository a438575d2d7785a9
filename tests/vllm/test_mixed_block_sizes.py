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
from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.block_groups import BlockGroups
from tests.vllm.conftest import cached_since, cached_by_source, generate, make_engine, shutdown
from tests.vllm.conftest import random_tokens as tokens
from tests.vllm.test_sliding_window import check_shared_prefix_rounds

ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=4 << 20)  # 42 logical blocks
LOGICAL = 64  # tokens of a logical block: the sliding-window group's block size


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


def test_host_and_disk_tiers_hold_every_groups_blocks(gemma4, engines, tmp_path):
    """A tier block is a logical block: its sliding-window block and its two full-attention
    blocks in one payload. Engine A (host and disk tiers) computes three prompts, forgets
    them on the device and loads their whole logical blocks back from host; engine B, a
    new engine on the same directory, loads them from disk. A group's blocks misplaced in
    the payload or the table would change the greedy outputs."""
    rng = random.Random(9)
    system = tokens(rng, 3 * LOGICAL + 20)
    prompts = [system + tokens(rng, 50 + 7 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in generate(engines["no-cache"], prompts, params)]
    whole = [(len(p) - 1) // LOGICAL * LOGICAL for p in prompts]
    tiers = engine_kwargs(host_cache_gb=0.05, disk_cache_dir=str(tmp_path))
    for source in ("host", "disk"):
        llm = make_engine(gemma4, "kvbackend", **ENGINE, disable_log_stats=False, **tiers)
        try:
            if source == "host":
                first = [generate(llm, [p], params)[0] for p in prompts]
                assert [o.outputs[0].token_ids for o in first] == want
                assert llm.reset_prefix_cache()  # the device forgets, the tiers keep
            before = cached_by_source(llm)
            got = [generate(llm, [p], params)[0] for p in prompts]  # one at a time
            gained = cached_since(llm, before)
        finally:
            shutdown(llm)
        assert [o.outputs[0].token_ids for o in got] == want
        assert [o.num_cached_tokens for o in got] == whole
        assert sum(gained.values()) == sum(whole) and gained[source] >= whole[0], gained
