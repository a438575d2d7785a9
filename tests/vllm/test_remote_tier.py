"""The remote tier inside the real vLLM engine: a fleet of engines sharing one Redis/Valkey.

Engines start one after the other (each its own engine-core process), on the tiny model,
against one server that the test starts:
  A  computes a long document (and writes its blocks through to the server);
  B  a fresh engine with cold device, host and disk: reuses >= 90% of the document from
     the server; greedy outputs identical to vLLM without any cache;
  P  the server paused (SIGSTOP) the moment a load reaches it: the loading request waits
     while another one runs to completion (remote loads are asynchronous); once the server
     resumes the load lands; outputs identical;
  C  every value in the server garbled: each is a miss, deleted and recomputed; then the
     server is stopped midway and restarted (empty): no request fails, outputs identical;
  D  another model (same config, other weights): finds nothing of A's.
"""

from __future__ import annotations

import random
import time

import pytest
from vllm import SamplingParams

from kvbackend.testing.tiny_model import build_tiny_llama
from kvbackend.vllm import engine_kwargs
from tests.redis_proxy import RedisProxy
from tests.redis_server import server  # noqa: F401 - the module's server
from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown

GREEDY = SamplingParams(temperature=0, max_tokens=8)
_rng = random.Random(11)
DOCUMENT = [_rng.randrange(1, 500) for _ in range(900)]
QUESTIONS = [[_rng.randrange(1, 500) for _ in range(12)] for _ in range(3)]
OTHERS = [[_rng.randrange(1, 500) for _ in range(300)] for _ in range(3)]


def remote_engine(model: str, url: str):
    return make_engine(model, "kvbackend", max_model_len=1024, disable_log_stats=False,
                       **engine_kwargs(remote_cache_url=url))


def run(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def texts(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompts():
    return [DOCUMENT + q for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(reference_llm, prompts):
    return texts(run(reference_llm, prompts + OTHERS))


@pytest.fixture(scope="module")
def engine_a(tiny_model, server, prompts, reference):
    llm = remote_engine(tiny_model, server.url)
    try:
        outs = run(llm, prompts[:1])
    finally:
        shutdown(llm)  # the connector's shutdown sends what is still queued
    assert texts(outs) == reference[:1]
    return outs


def test_a_second_engine_reuses_the_document(engine_a, tiny_model, server, prompts,
                                             reference):
    assert server.client().dbsize() >= len(DOCUMENT) // BLOCK_SIZE
    llm = remote_engine(tiny_model, server.url)
    try:
        outs = run(llm, prompts[1:2])
    finally:
        shutdown(llm)
    assert texts(outs) == reference[1:2]
    assert outs[0].num_cached_tokens >= 0.9 * len(DOCUMENT)


def test_a_server_paused_mid_load_stalls_no_other_request(engine_a, tiny_model, server,
                                                         prompts, reference):
    long_greedy = SamplingParams(temperature=0, max_tokens=40)
    raw = server.client()
    before = set(raw.scan_iter("kvb:*"))
    with RedisProxy(server, pause_on=b"GETRANGE") as proxy:
        # a 60 s socket timeout: a load that blocked the step loop would show as a 60 s step
        llm = remote_engine(tiny_model, proxy.url + "?socket_timeout=60")
        engine, finished, steps = llm.llm_engine, {}, []
        try:
            engine.add_request("other", {"prompt_token_ids": OTHERS[0]}, long_greedy)
            while not any(o.outputs[0].token_ids for o in engine.step()):
                pass  # "other" is decoding: its lookup is done
            engine.add_request("doc", {"prompt_token_ids": prompts[0]}, GREEDY)
            while "other" not in finished:  # the server stops at doc's load, in the first step
                start = time.monotonic()
                finished.update((o.request_id, o) for o in engine.step() if o.finished)
                steps.append(time.monotonic() - start)
            assert proxy.paused.is_set() and "doc" not in finished  # its load still waits
            server.resume()
            while engine.has_unfinished_requests():
                finished.update((o.request_id, o) for o in engine.step() if o.finished)
        finally:
            server.resume()
            shutdown(llm)
    added = set(raw.scan_iter("kvb:*")) - before  # "other"'s blocks: the server as A left it
    if added:
        raw.delete(*added)
    assert max(steps) < 10, steps
    assert texts([finished["doc"]]) == reference[:1]
    assert texts([finished["other"]])[0][:GREEDY.max_tokens] == reference[3]
    assert finished["doc"].num_cached_tokens >= 0.9 * len(DOCUMENT)


def test_garbled_values_and_a_server_that_goes_away_fail_no_request(
        engine_a, tiny_model, server, prompts, reference):
    raw = server.client()
    garbled = {}
    for name in raw.scan_iter("kvb:*"):  # every block A wrote: one flipped payload bit
        value = bytearray(raw.get(name))
        value[-1] ^= 1
        garbled[name] = bytes(value)
        raw.set(name, garbled[name])
    llm = remote_engine(tiny_model, server.url)
    try:
        outs = run(llm, prompts[2:])  # each load fails its check: deleted, recomputed
        assert garbled and all(raw.get(name) != value for name, value in garbled.items())
        server.stop()
        outs += run(llm, OTHERS[:2])
        server.start()  # empty now; the breakers retry after their delay
        outs += run(llm, OTHERS[2:])
    finally:
        shutdown(llm)
    # (the warnings, one per outage and tier client, are checked in test_store_remote_tier.py:
    # a worker's buffered output may be lost when vLLM kills it at shutdown)
    assert texts(outs) == reference[2:]  # prompts[2], then OTHERS


def test_another_model_finds_nothing(engine_a, tmp_path, server, prompts):
    other = build_tiny_llama(str(tmp_path / "other"), seed=1)
    llm = remote_engine(other, server.url)
    try:
        outs = run(llm, prompts[:1])
    finally:
        shutdown(llm)
    assert outs[0].num_cached_tokens == 0
