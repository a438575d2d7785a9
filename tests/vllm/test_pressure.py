"""kvbackend under memory pressure: preemption, eviction, vLLM's own metrics.

The engine gets room for 44 blocks of 32 tokens, far less than the batch
needs, so requests are preempted and cached blocks are evicted while others
still share them.
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown

BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * (K, V) * kv heads * head dim * float32


@pytest.fixture(scope="module")
def small_llm(tiny_model):
    llm = make_engine(tiny_model, "kvbackend", max_model_len=1024, disable_log_stats=False,
                      kv_cache_memory_bytes=44 * BLOCK_SIZE * BYTES_PER_TOKEN)
    yield llm
    shutdown(llm)


def counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_preemption_and_eviction_keep_outputs_exact(small_llm, reference_llm):
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(200)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(100)]}
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40)
    for _ in range(2):  # the second round runs on whatever the first left cached
        got = small_llm.generate(prompts, params, use_tqdm=False)
        want = reference_llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert counter(small_llm, "vllm:num_preemptions") > 0
    assert counter(small_llm, "vllm:prefix_cache_hits") > 0


def test_hits_flow_into_vllm_metrics_and_reset_clears_the_cache(small_llm):
    rng = random.Random(12)
    prompt = {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(150)]}
    params = SamplingParams(temperature=0, max_tokens=2)
    small_llm.generate([prompt], params, use_tqdm=False)
    queries = counter(small_llm, "vllm:prefix_cache_queries")
    hits = counter(small_llm, "vllm:prefix_cache_hits")
    (out,) = small_llm.generate([prompt], params, use_tqdm=False)
    assert out.num_cached_tokens == 149
    assert counter(small_llm, "vllm:prefix_cache_hits") - hits == 149
    assert counter(small_llm, "vllm:prefix_cache_queries") - queries == 150
    assert small_llm.reset_prefix_cache()
    (cold,) = small_llm.generate([prompt], params, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == out.outputs[0].token_ids


def test_retained_conversation_outlives_pressure_that_evicts_an_unretained_one(
        small_llm, reference_llm):
    """Two conversations end together, one with ``kv_retain_s``; five unrelated prompts
    then need more blocks than are free. The next turn of the retained one is a full
    hit; the same turn of the other one (no hint) finds its context evicted."""
    rng = random.Random(14)
    retained = [3] + [rng.randrange(4, 512) for _ in range(299)]
    plain = [4] + [rng.randrange(4, 512) for _ in range(299)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    hint = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_retain_s": 600})

    def turn(prompts, params):
        outs = small_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                  use_tqdm=False)
        want = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                      use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        return outs

    (first_retained,) = turn([retained], hint)
    (first_plain,) = turn([plain], greedy)
    for _ in range(5):  # 13 blocks each, 44 in all: ordinary entries make room first
        turn([[rng.randrange(4, 512) for _ in range(400)]], greedy)
    contexts = [retained + list(first_retained.outputs[0].token_ids),
                plain + list(first_plain.outputs[0].token_ids)]
    follow_ups = [context + [rng.randrange(4, 512) for _ in range(16)] for context in contexts]
    again_retained, again_plain = turn(follow_ups, greedy)
    assert again_retained.num_cached_tokens == len(contexts[0]) - 1  # all but the last token
    assert again_plain.num_cached_tokens < BLOCK_SIZE
    assert small_llm.reset_prefix_cache()  # drops the retention for the module's other tests
