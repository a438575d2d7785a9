"""Prefill/decode disaggregation over vLLM's NIXL connector, kvbackend on both sides: a
prefill engine in its own process (``kvbackend/testing/prefill_peer.py``) and a decode
engine here, real vLLM CPU engines moving KV through NIXL's UCX backend.

The decode instance pulls only what its token-exact local hit lacks: NIXL pulls into the
blocks of the request's table that carry no vLLM block hash, and kvbackend hashes exactly
the blocks it took from its cache (before: refused at start). The prefill instance holds
a prefilled request's blocks, shared cached ones included, until the decode instance
pulled them, through pressure that evicts everything else. A pull that fails publishes
nothing. Greedy outputs always equal vLLM's without any cache.
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from kvbackend.core import cdiv
from kvbackend.testing.prefill_peer import PrefillPeer, free_port, own_side_channel
from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import (
    BLOCK_SIZE, cached_by_source, engine_args, greedy_outputs, make_engine, random_tokens,
    shutdown,
)

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PREFILL_BLOCKS = 64  # the prefill engine's pool, in blocks (a block: 32 KiB)
_rng = random.Random(11)
BASE = random_tokens(_rng, 3 * BLOCK_SIZE)  # three whole blocks two prompts share
FIRST = BASE + random_tokens(_rng, 11)
SECOND = BASE + random_tokens(_rng, 40)


@pytest.fixture(scope="module")
def prefill(tiny_model):
    peer = PrefillPeer(engine_args(tiny_model, "kvbackend", max_model_len=512,
                                   kv_cache_memory_bytes=PREFILL_BLOCKS * 32 * 1024,
                                   **engine_kwargs(NIXL)))
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode(tiny_model):
    with own_side_channel():
        llm = make_engine(tiny_model, "kvbackend", disable_log_stats=False, **engine_kwargs(NIXL))
    yield llm
    shutdown(llm)


def pulled_bytes(llm) -> float:
    return sum(m.sum for m in llm.get_metrics() if m.name == "vllm:nixl_bytes_transferred")


def decode_after(prefilled: dict, llm, prompt: list[int]) -> tuple[list[int], dict, float]:
    """Decode ``prompt`` on ``llm`` from the prefill instance's KV: its greedy tokens, the
    tokens hit per source ("device": kvbackend's, "p2p": pulled) and the bytes pulled."""
    before, pulled = cached_by_source(llm), pulled_bytes(llm)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens,
                            extra_args={"kv_transfer_params": prefilled["params"]})
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    hits = {s: n - before.get(s, 0) for s, n in cached_by_source(llm).items()
            if n != before.get(s, 0)}
    return list(out.outputs[0].token_ids), hits, pulled_bytes(llm) - pulled


def test_decode_pulls_only_what_its_local_hit_lacks(prefill, decode, reference_llm):
    reference = greedy_outputs(reference_llm, (FIRST, SECOND), GREEDY)
    tokens, hits, first_bytes = decode_after(prefill.ask(FIRST, True), decode, FIRST)
    assert (tokens, hits) == (reference[tuple(FIRST)], {"p2p": len(FIRST)})
    block_bytes = first_bytes / cdiv(len(FIRST), BLOCK_SIZE)  # every block pulled
    tokens, hits, second_bytes = decode_after(prefill.ask(SECOND, True), decode, SECOND)
    assert (tokens, hits) == (reference[tuple(SECOND)], {"device": len(BASE),
                                                          "p2p": len(SECOND) - len(BASE)})
    # Only the blocks past the local hit: pulling into the hit's blocks (unhashed) were 5.
    assert second_bytes == cdiv(len(SECOND) - len(BASE), BLOCK_SIZE) * block_bytes


def test_prefill_holds_a_prefilled_requests_blocks_until_they_were_pulled(
        prefill, decode, reference_llm):
    """Its table starts with blocks the prefill engine's cache shares; then requests
    needing more than its whole pool run there before the decode instance pulls."""
    rng = random.Random(12)
    shared = random_tokens(rng, 3 * BLOCK_SIZE)
    prompt = shared + random_tokens(rng, 50)
    prefill.ask(shared + random_tokens(rng, 9), False)  # cached there, not on the decoder
    prefilled = prefill.ask(prompt, True)
    pressure = [random_tokens(rng, 10 * BLOCK_SIZE) for _ in range(PREFILL_BLOCKS // 8)]
    for other in pressure:  # 80 blocks through a 64-block pool
        prefill.ask(other, False)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    tokens, hits, _ = decode_after(prefilled, decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})


def test_a_failed_pull_fails_its_request_and_publishes_nothing(prefill, decode, reference_llm):
    """The prefill instance named in the request is not there (the handshake fails): the
    request fails (vLLM's default ``kv_load_failure_policy``), and none of the blocks it
    was to pull into is published, so a later request for the same prompt hits nothing of
    it on the device and pulls it whole."""
    prompt = random_tokens(random.Random(13), 4 * BLOCK_SIZE + 3)
    reference = greedy_outputs(reference_llm, [prompt], GREEDY)
    prefilled = prefill.ask(prompt, True)
    astray = {**prefilled["params"], "remote_engine_id": "gone", "remote_port": free_port()}
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens,
                            extra_args={"kv_transfer_params": astray})
    (out,) = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert (out.outputs[0].finish_reason, list(out.outputs[0].token_ids)) == ("error", [])
    tokens, hits, _ = decode_after(prefill.ask(prompt, True), decode, prompt)
    assert (tokens, hits) == (reference[tuple(prompt)], {"p2p": len(prompt)})
