"""Prefill/decode disaggregation over vLLM's NIXL connector, kvbackend on both sides: a
prefill engine in its own process (``kvbackend/testing/prefill_peer.py``) and a decode
engine here, real vLLM CPU engines moving KV through NIXL's UCX backend.

Both of NIXL's modes: pull (the decode instance reads the prefill instance's blocks) and
push (the decode instance names its blocks, and the prefill instance writes them; the two
requests share an id, as a P/D proxy gives them). The decode instance receives only what
its token-exact local hit lacks: NIXL moves into the blocks of the request's table that
carry no vLLM block hash, and kvbackend hashes exactly the blocks it took from its cache
(before: refused at start). The prefill instance holds a prefilled request's blocks,
shared cached ones included, until they were moved, through pressure that evicts
everything else. A transfer that fails publishes nothing. Greedy outputs always equal
vLLM's without any cache.
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from kvbackend.core import cdiv
from kvbackend.testing.prefill_peer import PrefillPeer, free_port, moved_bytes, nixl_engine
from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import (
    BLOCK_SIZE, engine_args, greedy_outputs, make_engine, random_tokens, shutdown,
)
from tests.vllm.nixl_harness import GREEDY, decode_after, nixl  # noqa: F401

PREFILL_BLOCKS = 64  # the prefill engine's pool, in blocks (a block: 32 KiB)
_rng = random.Random(11)
BASE = random_tokens(_rng, 3 * BLOCK_SIZE)  # three whole blocks two prompts share
FIRST = BASE + random_tokens(_rng, 11)
SECOND = BASE + random_tokens(_rng, 40)


@pytest.fixture(scope="module")
def prefill(tiny_model, nixl):
    peer = PrefillPeer(engine_args(tiny_model, "kvbackend", max_model_len=512,
                                   kv_cache_memory_bytes=PREFILL_BLOCKS * 32 * 1024,
                                   disable_log_stats=False, **engine_kwargs(nixl)))
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode(tiny_model, nixl):
    with nixl_engine():
        llm = make_engine(tiny_model, "kvbackend", disable_log_stats=False, **engine_kwargs(nixl))
    yield llm
    shutdown(llm)


def test_decode_receives_only_what_its_local_hit_lacks(prefill, decode, reference_llm):
    reference = greedy_outputs(reference_llm, (FIRST, SECOND), GREEDY)
    start = moved_bytes(prefill, decode)
    tokens, hits = decode_after(prefill.ask(FIRST, True), decode, FIRST)
    assert (tokens, hits) == (reference[tuple(FIRST)], {"p2p": len(FIRST)})
    first = moved_bytes(prefill, decode)
    block_bytes = (first - start) / cdiv(len(FIRST), BLOCK_SIZE)  # every block moved
    assert block_bytes > 0
    tokens, hits = decode_after(prefill.ask(SECOND, True), decode, SECOND)
    assert (tokens, hits) == (reference[tuple(SECOND)], {"device": len(BASE),
                                                          "p2p": len(SECOND) - len(BASE)})
    # Only the blocks past the local hit: moving into the hit's blocks (unhashed) were 5.
    second_bytes = moved_bytes(prefill, decode) - first
    assert second_bytes == cdiv(len(SECOND) - len(BASE), BLOCK_SIZE) * block_bytes


def test_prefill_holds_a_prefilled_requests_blocks_until_they_were_moved(
        prefill, decode, reference_llm):
    """Its table starts with blocks the prefill engine's cache shares; then requests
    needing more than its whole pool run there before the decode instance asks for it."""
    rng = random.Random(12)
    shared = random_tokens(rng, 3 * BLOCK_SIZE)
    prompt = shared + random_tokens(rng, 50)
    prefill.ask(shared + random_tokens(rng, 9), False)  # cached there, not on the decoder
    prefilled = prefill.ask(prompt, True)
    pressure = [random_tokens(rng, 10 * BLOCK_SIZE) for _ in range(PREFILL_BLOCKS // 8)]
    for other in pressure:  # 80 blocks through a 64-block pool
        prefill.ask(other, False)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    tokens, hits = decode_after(prefilled, decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})


def test_a_failed_transfer_fails_its_request_and_publishes_nothing(
        prefill, decode, reference_llm):
    """The prefill instance named in the request is not there (the handshake fails): the
    request fails (vLLM's default ``kv_load_failure_policy``), and none of the blocks it
    was to receive into is published, so a later request for the same prompt hits nothing
    of it on the device and receives it whole."""
    prompt = random_tokens(random.Random(13), 4 * BLOCK_SIZE + 3)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    prefilled = prefill.ask(prompt, True)
    astray = {**prefilled["params"], "remote_engine_id": "gone", "remote_port": free_port()}
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens,
                            extra_args={"kv_transfer_params": astray})
    (out,) = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert (out.outputs[0].finish_reason, list(out.outputs[0].token_ids)) == ("error", [])
    tokens, hits = decode_after(prefill.ask(prompt, True), decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})
