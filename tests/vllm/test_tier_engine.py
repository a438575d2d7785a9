"""The README's recommended configuration (host + disk tiers) on the real vLLM CPU engine,
in the two situations that went wrong: a document whose first block left host memory
before its later blocks (the engine core died of a KeyError inside ``schedule()``), and
``reset_prefix_cache(reset_connector=True)`` after a weight update (KV from before was
served from disk). Greedy outputs are compared with vLLM without any cache.
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown
from tests.vllm.tier_harness import host_gb

GREEDY = SamplingParams(temperature=0, max_tokens=8)
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * (K, V) * kv heads * head dim * float32
_rng = random.Random(17)
DOCUMENT = [_rng.randrange(3, 512) for _ in range(4 * BLOCK_SIZE + 1)]  # 4 full blocks
OTHER = [_rng.randrange(3, 512) for _ in range(BLOCK_SIZE + 1)]  # 1 full block


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
    outs = reference_llm.generate([{"prompt_token_ids": p} for p in (DOCUMENT, OTHER)], GREEDY,
                                  use_tqdm=False)
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip((DOCUMENT, OTHER), outs)}


def run(llm, prompt, reference):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference[tuple(prompt)]
    return out


def cached_by_source(llm) -> dict[str, float]:
    return {m.labels["source"]: m.value for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"}


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


def test_nothing_from_before_a_connector_reset_is_served(llm, reference):
    run(llm, DOCUMENT, reference)
    assert llm.reset_prefix_cache(reset_connector=True)  # after a weight update
    out = run(llm, DOCUMENT, reference)
    assert out.num_cached_tokens == 0  # not from disk, not from host
    assert llm.reset_prefix_cache()  # the device only: the host tier serves the new KV
    assert run(llm, DOCUMENT, reference).num_cached_tokens == 4 * BLOCK_SIZE

