"""kvbackend serving a model with several KV-cache groups: a tiny Gemma-3-style model
(two sliding-window layers with a 64-token window, one full-attention layer).

vLLM gives it three KV-cache groups. Prompts are longer than the window, so the
sliding-window layers attend to a different context than the full layer, and a
block table that misplaced any group's blocks would change the greedy outputs.
Each configuration is one module-scoped engine: kvbackend, vLLM without prefix
caching (the ground truth) and vLLM's own prefix caching (the hit baseline).
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from kvbackend.testing.tiny_model import build_tiny_gemma3
from tests.token_reference import lcp
from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown

GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=4 << 20)  # 85 blocks in all 3 groups


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return build_tiny_gemma3(str(tmp_path_factory.mktemp("tiny-gemma3")))


def _engine(model: str, mode: str, **overrides):
    llm = make_engine(model, mode, **ENGINE, **overrides)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvb(gemma):
    yield from _engine(gemma, "kvbackend", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def ref(gemma):
    yield from _engine(gemma, "no-cache")


@pytest.fixture(scope="module")
def apc(gemma):
    yield from _engine(gemma, "vllm-apc")


def run(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def test_every_engine_runs_the_model_with_three_groups(kvb, ref, apc):
    """With its hybrid KV-cache manager vLLM puts the three layers in three groups that
    share one KV tensor, so the pool holds one layer's pages; as one full-attention
    group (hybrid manager off) it would hold a third as many."""
    one_layer_page = BLOCK_SIZE * 2 * 1 * 64 * 4  # tokens * (K, V) * KV heads * head dim * fp32
    for llm in (kvb, ref, apc):
        config = llm.llm_engine.vllm_config
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager
        num_blocks = config.cache_config.num_gpu_blocks
        assert num_blocks == ENGINE["kv_cache_memory_bytes"] // one_layer_page


def test_shared_prefixes_partial_blocks_and_branches_match_vllm(kvb, ref, apc):
    """Rounds of prompts whose hits end mid-block, branch inside a block and continue
    a conversation. kvbackend's hits are exactly the longest cached prefix (token-
    exact, every group), never below vLLM's prefix caching, and outputs match."""
    for llm in (kvb, apc):
        assert llm.reset_prefix_cache()
    rng = random.Random(7)
    system = tokens(rng, 6 * BLOCK_SIZE + 13)  # longer than the window, ends mid-block
    convo = system + tokens(rng, 90)
    rounds = [
        [system + tokens(rng, 20)],
        [system + tokens(rng, 15 + i) for i in range(3)],  # hits end 13 tokens into a block
        [convo],
        [convo[:250] + tokens(rng, 40)],  # diverges 26 tokens into block 7
        [convo[:250] + tokens(rng, 30), system + tokens(rng, 5)],
    ]
    cached: list[list[int]] = []  # every finished request leaves prompt + outputs[:-1]
    ours_total = theirs_total = 0
    for prompts in rounds:
        expected = [min(len(p) - 1, max((lcp(p, c) for c in cached), default=0))
                    for p in prompts]
        got, want, base = run(kvb, prompts), run(ref, prompts), run(apc, prompts)
        for prompt, g, w, b, hit in zip(prompts, got, want, base, expected):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids == b.outputs[0].token_ids
            assert g.num_cached_tokens == hit
            assert g.num_cached_tokens >= b.num_cached_tokens
            cached.append(prompt + list(g.outputs[0].token_ids[:-1]))
            ours_total, theirs_total = ours_total + hit, theirs_total + b.num_cached_tokens
    assert ours_total > theirs_total


def test_memory_pressure_keeps_outputs_exact(kvb, ref):
    """Eight 540-token requests need 136 blocks per group; the pool has 84, so cached
    blocks are evicted (in every group at once) while others share them, and the
    second round hits only what survived."""
    assert kvb.reset_prefix_cache()
    rng = random.Random(11)
    shared = tokens(rng, 200)
    prompts = [shared + tokens(rng, 300) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40)
    for _ in range(2):  # the second round runs on whatever the first left cached
        got, want = run(kvb, prompts, params), run(ref, prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    hits = [o.num_cached_tokens for o in got]
    assert all(h >= len(shared) for h in hits)  # the shared prefix is never evicted
    assert sum(hits) < sum(len(p) - 1 for p in prompts)  # but some requests' tails were


def test_with_a_tier_vllm_serves_the_model_as_one_full_attention_group(gemma):
    """kvbackend's tier connector is not ``SupportsHMA``: with a tier, vLLM turns its
    hybrid KV-cache manager off and caches the sliding-window layers as full attention
    (one group, more memory), which kvbackend's tiers serve."""
    from vllm.engine.arg_utils import EngineArgs

    from kvbackend.vllm import engine_kwargs

    config = EngineArgs(model=gemma, dtype="float32", block_size=BLOCK_SIZE, **ENGINE,
                        **engine_kwargs(host_cache_gb=0.01)).create_engine_config()
    assert config.scheduler_config.disable_hybrid_kv_cache_manager
    plain = EngineArgs(model=gemma, dtype="float32", block_size=BLOCK_SIZE, **ENGINE,
                       **engine_kwargs()).create_engine_config()
    assert not plain.scheduler_config.disable_hybrid_kv_cache_manager
