"""The README's recommended configuration (host + disk tiers) on the real vLLM CPU engine,
in the two situations that went wrong: a document whose first block left host memory
before its later blocks (the engine core died of a KeyError inside ``schedule()``), and
``reset_prefix_cache(reset_connector=True)`` after a weight update (KV from before was
served from disk); and ``kv_retain_s`` keeping an agent's context in the host tier.
Greedy outputs are compared with vLLM without any cache.
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import (
    BLOCK_SIZE, cached_by_source, greedy_outputs, make_engine, shutdown,
)
from tests.vllm.tier_harness import host_gb

GREEDY = SamplingParams(temperature=0, max_tokens=8)
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * (K, V) * kv heads * head dim * float32
_rng = random.Random(17)
DOCUMENT = [_rng.randrange(3, 512) for _ in range(4 * BLOCK_SIZE + 1)]  # 4 full blocks
OTHER = [_rng.randrange(3, 512) for _ in range(BLOCK_SIZE + 1)]  # 1 full block
AGENT = [_rng.randrange(3, 512) for _ in range(2 * BLOCK_SIZE + 1)]  # 2 full blocks
CHATS = [[_rng.randrange(3, 512) for _ in range(BLOCK_SIZE + 1)] for _ in range(4)]
PROMPTS = (DOCUMENT, OTHER, AGENT, *CHATS)


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    engine = make_engine(tiny_model, "kvbackend", max_model_len=512, disable_log_stats=False,
                         kv_cache_memory_bytes=24 * BLOCK_SIZE * BYTES_PER_TOKEN,
                         **engine_kwargs(host_cache_gb=host_gb(4),
                                         disk_cache_dir=str(tmp_path_factory.mktemp("kv-disk"))))
    yield engine
    shutdown(engine)


@pytest.fixture(scope="module")
def reference(reference_llm):
    return greedy_outputs(reference_llm, PROMPTS, GREEDY)


def run(llm, prompt, reference, params=GREEDY):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference[tuple(prompt)]
    return out


def test_first_block_from_disk_and_the_rest_from_a_full_host_tier(llm, reference):
    run(llm, DOCUMENT, reference)  # host: the document's 4 blocks (full); disk: the same
    run(llm, OTHER, reference)  # host evicts the document's block 0
    assert llm.reset_prefix_cache()  # the device forgets both
    before = cached_by_source(llm)
    out = run(llm, DOCUMENT, reference)  # block 0 from disk into the full host tier, 1-3 host
    assert out.num_cached_tokens == 4 * BLOCK_SIZE
    after = cached_by_source(llm)
    assert after["disk"] - before["disk"] == BLOCK_SIZE
    assert after["host"] - before["host"] == 3 * BLOCK_SIZE


def test_requests_queued_behind_others_are_prefetched_and_served_right(llm, reference):
    """Issue 14 item 2: each request queued behind another has its disk blocks prefetched
    into the (full) host tier on arrival; outputs stay those of no caching."""
    for prompt in (DOCUMENT, OTHER, *CHATS[:3]):  # the document's blocks leave the host tier
        run(llm, prompt, reference)
    assert llm.reset_prefix_cache()  # and the device: they are on disk only
    prompts = [OTHER, DOCUMENT, OTHER, DOCUMENT]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == reference[tuple(prompt)]
    assert outs[1].num_cached_tokens == 4 * BLOCK_SIZE


def test_nothing_from_before_a_connector_reset_is_served(llm, reference):
    run(llm, DOCUMENT, reference)
    assert llm.reset_prefix_cache(reset_connector=True)  # after a weight update
    out = run(llm, DOCUMENT, reference)
    assert out.num_cached_tokens == 0  # not from disk, not from host
    assert llm.reset_prefix_cache()  # the device only: the host tier serves the new KV
    assert run(llm, DOCUMENT, reference).num_cached_tokens == 4 * BLOCK_SIZE



def test_a_retained_context_stays_in_a_host_tier_that_ordinary_prompts_churn(llm, reference):
    """The host tier holds 4 blocks, 2 of them retained at most (max_retained_fraction
    0.5): the agent's 2 blocks, retained with ``kv_retain_s``, outlast 4 ordinary blocks
    and its resumed prompt loads them (issue 14)."""
    assert llm.reset_prefix_cache(reset_connector=True)  # host empty, disk off from here
    retain = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_retain_s": 600})
    run(llm, AGENT, reference, retain)
    for chat in CHATS:
        run(llm, chat, reference)
    assert llm.reset_prefix_cache()  # the device forgets them all
    assert run(llm, AGENT, reference).num_cached_tokens == 2 * BLOCK_SIZE
