"""Prefill/decode disaggregation over NIXL with kvbackend's host tier on both instances,
composed through vLLM's ``MultiConnector`` (``engine_kwargs(NIXL, host_cache_gb=...)``),
NIXL in pull and in push mode: real vLLM CPU engines, the prefill instance in its own
process.

vLLM's ``MultiConnector`` gives a request to the first connector with a hit past the
local one, and ``compose`` puts NIXL before kvbackend's tier connector: a request a
prefill instance computed receives all of it that the device lacks, even where the host
tier holds a part (the decode instance would prefill the rest), and the host tier serves
the other requests. A pull that fails is recomputed (the tier connector's
``kv_load_failure_policy``). The prefill instance holds a prefilled request's blocks
until both connectors are done with them. Greedy outputs always equal vLLM's without any
cache.
"""

from __future__ import annotations

import random

import pytest

from kvbackend.core import cdiv
from kvbackend.testing.prefill_peer import PrefillPeer, free_port, moved_bytes, nixl_engine
from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import (
    BLOCK_SIZE, cached_by_source, cached_since, engine_args, generate, greedy_outputs,
    make_engine, random_tokens, shutdown,
)
from tests.vllm.nixl_harness import GREEDY, decode_after, nixl  # noqa: F401
from tests.vllm.tier_harness import host_gb

PREFILL_BLOCKS = 64  # the prefill engine's device pool, in blocks
BLOCK_BYTES = 32 * 1024  # a block of the tiny Llama, all layers
HOST_GB = host_gb(32)


@pytest.fixture(scope="module")
def prefill(tiny_model, nixl):
    peer = PrefillPeer(engine_args(tiny_model, "kvbackend", max_model_len=512,
                                   kv_cache_memory_bytes=PREFILL_BLOCKS * BLOCK_BYTES,
                                   disable_log_stats=False,
                                   **engine_kwargs(nixl, host_cache_gb=HOST_GB)))
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode(tiny_model, nixl):
    with nixl_engine():
        llm = make_engine(tiny_model, "kvbackend", disable_log_stats=False,
                          **engine_kwargs(nixl, host_cache_gb=HOST_GB))
    yield llm
    shutdown(llm)


def test_nixl_serves_a_prefilled_request_and_the_host_tier_the_others(
        prefill, decode, reference_llm):
    rng = random.Random(21)
    prompt = random_tokens(rng, 3 * BLOCK_SIZE + 7)
    longer = prompt + random_tokens(rng, 40)
    reference = greedy_outputs(reference_llm, (prompt, longer), GREEDY)
    tokens, hits = decode_after(prefill.ask(prompt, True), decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})
    assert decode.reset_prefix_cache()  # the device forgets; the host tier keeps the pull
    before = moved_bytes(prefill, decode)
    tokens, hits = decode_after(prefill.ask(longer, True), decode, longer)
    # Not 3 blocks from host and 47 tokens prefilled here (the tier connector first).
    assert (tokens, hits) == (reference[tuple(longer)], {"p2p": len(longer)})
    assert moved_bytes(prefill, decode) - before == cdiv(len(longer), BLOCK_SIZE) * BLOCK_BYTES
    assert decode.reset_prefix_cache()
    before = cached_by_source(decode)
    (out,) = generate(decode, [longer], GREEDY)  # no prefill instance: the host tier serves
    loaded = cached_since(decode, before)
    assert (list(out.outputs[0].token_ids), loaded) == (
        reference[tuple(longer)], {"host": (len(longer) - 1) // BLOCK_SIZE * BLOCK_SIZE})


def test_the_prefill_holds_its_blocks_through_pressure_on_device_and_host(
        prefill, decode, reference_llm):
    rng = random.Random(22)
    prompt = random_tokens(rng, 5 * BLOCK_SIZE + 3)
    prefilled = prefill.ask(prompt, True)
    for _ in range(PREFILL_BLOCKS // 8):  # 80 blocks through 64 on the device, 32 on host
        prefill.ask(random_tokens(rng, 10 * BLOCK_SIZE), False)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    before = moved_bytes(prefill, decode)
    tokens, hits = decode_after(prefilled, decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})
    assert moved_bytes(prefill, decode) - before == cdiv(len(prompt), BLOCK_SIZE) * BLOCK_BYTES


def test_a_failed_pull_is_recomputed_on_the_decoder(prefill, decode, reference_llm):
    """The prefill instance named is not there: the request computes the prompt itself,
    and what it published serves the next request for it."""
    prompt = random_tokens(random.Random(23), 4 * BLOCK_SIZE + 3)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    prefilled = prefill.ask(prompt, True)
    astray = {"params": {**prefilled["params"], "remote_engine_id": "gone",
                         "remote_port": free_port()}}
    before = moved_bytes(prefill, decode)
    tokens, _ = decode_after(astray, decode, prompt)
    assert (tokens, moved_bytes(prefill, decode)) == (reference[tuple(prompt)], before)
    (out,) = generate(decode, [prompt], GREEDY)
    assert (list(out.outputs[0].token_ids), out.num_cached_tokens) == (
        reference[tuple(prompt)], len(prompt) - 1)
