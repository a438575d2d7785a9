"""kvbackend serving a model with several KV-cache groups: a tiny Gemma-3-style model
(two sliding-window layers with a 64-token window, one full-attention layer).

vLLM gives it three KV-cache groups. Prompts are longer than the window, so the
sliding-window layers attend to a different context than the full layer, and a
block table that misplaced any group's blocks would change the greedy outputs.
Each configuration is one module-scoped engine: kvbackend, vLLM without prefix
caching (the ground truth) and vLLM's own prefix caching (the hit baseline).
"""

from __future__ import annotations

import glob
import os
import random

import pytest
from vllm import SamplingParams

from kvbackend.store import compute_block_keys
from kvbackend.store.disk_tier import FORMAT_DIR
from kvbackend.store.layout import block_path
from kvbackend.testing.tiny_model import build_tiny_gemma3
from tests.redis_server import server  # noqa: F401 - the remote tier's fixture
from tests.store_helpers import damage_file
from tests.token_reference import lcp
from tests.vllm.conftest import (
    BLOCK_SIZE, assert_one_request_failed_a_damaged_load, cached_by_source, generate, make_engine,
    shutdown,
)
from tests.vllm.conftest import random_tokens as tokens

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
    return generate(llm, prompts, params)


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
    check_shared_prefix_rounds(kvb, ref, apc)


def check_shared_prefix_rounds(kvb, ref, apc) -> None:
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
    """Twenty-four 540-token requests sharing 200 tokens need 270 full-attention blocks;
    the pool has 255 pages for all three groups, so cached blocks and idle window pages
    are taken back (in one least-recently-used order) while others share them, and the
    second round hits only what survived: most of it the shared prefix's whole blocks
    (vLLM's prefix caching hits those at most)."""
    assert kvb.reset_prefix_cache()
    rng = random.Random(11)
    shared = tokens(rng, 200)
    prompts = [shared + tokens(rng, 300) for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=40)
    for _ in range(2):  # the second round runs on whatever the first left cached
        got, want = run(kvb, prompts, params), run(ref, prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    hits = [o.num_cached_tokens for o in got]
    # The shared prefix's full blocks stay (every hit uses them); its window pages may go
    # between hits, and come back with the next request that recomputes them.
    assert sum(h >= len(shared) // BLOCK_SIZE * BLOCK_SIZE for h in hits) > len(hits) // 2
    assert sum(hits) < sum(len(p) - 1 for p in prompts)  # but some requests' tails were


def test_a_context_longer_than_every_groups_blocks_is_served(gemma, ref):
    """With 1 MiB of KV cache the pool has 63 usable pages. A 1024-token request takes 32
    of them in the full-attention group and, with 256-token chunks and a 64-token window,
    at most 10 in each sliding-window group (vLLM's admission cap): 52. Keeping every
    group's blocks (96) kvbackend refused such a max_model_len; now it frees the pages
    no window reaches. Outputs match vLLM without caching, and the conversation's next
    turn hits all of the first (vLLM's prefix caching, in the same pool: at most its
    whole blocks)."""
    small = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=256)
    rng = random.Random(5)
    first = [tokens(rng, 900)]
    engines = [make_engine(gemma, "kvbackend", **small), make_engine(gemma, "vllm-apc", **small)]
    try:
        answers = [run(llm, first) for llm in engines]
        assert all(a[0].outputs[0].token_ids == run(ref, first)[0].outputs[0].token_ids
                   for a in answers)
        turn = [first[0] + list(answers[0][0].outputs[0].token_ids) + tokens(rng, 40)]
        (ours,), (theirs,) = (run(llm, turn) for llm in engines)
    finally:
        for llm in engines:
            shutdown(llm)
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids == run(
        ref, turn)[0].outputs[0].token_ids
    assert ours.num_cached_tokens == 900 + 5
    assert ours.num_cached_tokens >= theirs.num_cached_tokens > 0


def test_a_context_longer_than_every_groups_blocks_comes_back_from_the_host_tier(gemma, ref):
    """The 1 MiB pool above with a host tier: the sliding-window pages are still freed
    once out of every window (a tier block is saved while its window holds them, with
    every group's KV), so the engine starts (keeping every group's blocks, kvbackend
    refused this max_model_len with a tier) and the 900-token request runs. With the
    device cache dropped, the next turn loads all 28 whole blocks from host: every
    group's KV for the blocks its window reads, the full-attention KV for the others,
    which get no window pages."""
    from kvbackend.vllm import engine_kwargs

    small = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=256)
    block_bytes = 3 * BLOCK_SIZE * 2 * 1 * 64 * 4  # a page of each group's one layer
    rng = random.Random(5)
    first = [tokens(rng, 900)]
    llm = make_engine(gemma, "kvbackend", **small, disable_log_stats=False, **engine_kwargs(
        host_cache_gb=64 * block_bytes / (1 << 30)))
    try:
        (answer,) = run(llm, first)
        assert answer.outputs[0].token_ids == run(ref, first)[0].outputs[0].token_ids
        turn = [first[0] + list(answer.outputs[0].token_ids) + tokens(rng, 40)]
        assert llm.reset_prefix_cache()
        before = cached_by_source(llm)
        (ours,) = run(llm, turn)
        gained = {k: v - before.get(k, 0) for k, v in cached_by_source(llm).items()}
    finally:
        shutdown(llm)
    assert ours.outputs[0].token_ids == run(ref, turn)[0].outputs[0].token_ids
    assert ours.num_cached_tokens == gained["host"] == 900 // BLOCK_SIZE * BLOCK_SIZE


def test_with_a_tier_vllm_keeps_its_hybrid_manager(gemma):
    """kvbackend's tier connector is ``SupportsHMA``: with a tier, vLLM keeps the three
    KV-cache groups (it turns its hybrid manager off for a connector that is not)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvbackend.vllm import engine_kwargs

    config = EngineArgs(model=gemma, dtype="float32", block_size=BLOCK_SIZE, **ENGINE,
                        **engine_kwargs(host_cache_gb=0.01)).create_engine_config()
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager


def _block_files(directory) -> set[str]:
    return set(glob.glob(os.path.join(str(directory), FORMAT_DIR, "*", "*", "*.kvb")))


def _tier_workload() -> tuple[list[int], list[list[int]], list[int]]:
    """A system prompt, three prompts on it and one alone, all longer than the window,
    and each prompt's whole-block length (what a tier can serve)."""
    rng = random.Random(23)
    system = tokens(rng, 140)
    prompts = [system + tokens(rng, 160 + 9 * i) for i in range(3)] + [tokens(rng, 250)]
    return system, prompts, [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


def test_host_and_disk_tiers_serve_every_group(gemma, ref, apc, tmp_path, capfd):
    """Engine A (host + disk tiers) computes four prompts longer than the window, forgets
    them on the device and loads them back from its host tier; engine B, a new process
    on the same disk directory, loads them from disk, one of them through a damaged file
    (the whole request is recomputed: vLLM takes no failed block ids with several
    groups). Each tier block holds all three groups' KV, so a misplaced group or a hit
    missing one would change the greedy outputs, which match vLLM without caching."""
    from kvbackend.vllm import engine_kwargs

    system, prompts, aligned = _tier_workload()
    want = [o.outputs[0].token_ids for o in run(ref, prompts)]
    block_bytes = 3 * BLOCK_SIZE * 2 * 1 * 64 * 4  # a page of each group's one layer
    disk = dict(disk_cache_dir=str(tmp_path))

    assert apc.reset_prefix_cache()
    llm = make_engine(gemma, "kvbackend", **ENGINE, disable_log_stats=False, **engine_kwargs(
        host_cache_gb=64 * block_bytes / (1 << 30), **disk))
    try:
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == (
            ENGINE["kv_cache_memory_bytes"] * 3 // block_bytes)  # three groups, one tensor
        written = []
        for prompt, w in zip(prompts, want):  # one at a time: each writes its own files
            before = _block_files(tmp_path)
            (got,), (base,) = run(llm, [prompt]), run(apc, [prompt])
            assert got.outputs[0].token_ids == w == base.outputs[0].token_ids
            assert got.num_cached_tokens >= base.num_cached_tokens
            written.append(sorted(_block_files(tmp_path) - before, key=os.path.getmtime))
        assert all(os.path.getsize(f) > block_bytes for f in written[0])
        assert llm.reset_prefix_cache() and apc.reset_prefix_cache()  # the device forgets
        before = cached_by_source(llm)
        got, base = run(llm, prompts), run(apc, prompts)
        assert [o.outputs[0].token_ids for o in got] == want
        assert [o.num_cached_tokens for o in got] == aligned  # every whole block
        assert all(g.num_cached_tokens >= b.num_cached_tokens for g, b in zip(got, base))
        gained = {k: v - before.get(k, 0) for k, v in cached_by_source(llm).items()}
        assert sum(gained.values()) == sum(aligned), gained
        # From host, but the shared system prompt of a request admitted after the first
        # one's load published it on the device.
        shared = len(system) // BLOCK_SIZE * BLOCK_SIZE
        assert gained["host"] >= sum(aligned) - 2 * shared, gained
    finally:
        shutdown(llm)

    # the last prompt's fifth block, damaged between the runs (named by its key: blocks
    # saved in one step may share a modification time)
    (base,) = glob.glob(os.path.join(str(tmp_path), FORMAT_DIR, "*", ""))
    victim = block_path(base, compute_block_keys(
        prompts[3], BLOCK_SIZE, os.path.basename(base.rstrip("/")))[4])
    assert victim in written[3]
    damage_file(victim, rot=True)
    capfd.readouterr()
    llm = make_engine(gemma, "kvbackend", **ENGINE, **engine_kwargs(**disk))  # B: a new process
    try:
        got = run(llm, prompts[:3])
        assert [o.outputs[0].token_ids for o in got] == want[:3]
        assert [o.num_cached_tokens for o in got] == aligned[:3]  # from disk
        (damaged,) = run(llm, prompts[3:])
        assert damaged.outputs[0].token_ids == want[3]
        assert damaged.num_cached_tokens == 4 * BLOCK_SIZE  # the blocks before the bad one
    finally:
        shutdown(llm)
    assert_one_request_failed_a_damaged_load(capfd)


def test_a_remote_tier_serves_every_group_to_another_engine(gemma, ref, server):
    """Engine A writes four prompts longer than the window through to a real Redis
    server; engine B, a new process with a cold device and no local tier, loads every
    whole block of them from the server (each value holds all three groups' KV, so a
    misplaced or missing group would change the greedy outputs, which match vLLM
    without caching). Then every value in the server is garbled: each load fails its
    check, and vLLM recomputes the whole request (several groups: no failed block ids),
    with the same outputs."""
    from kvbackend.vllm import engine_kwargs

    system, prompts, aligned = _tier_workload()
    want = [o.outputs[0].token_ids for o in run(ref, prompts)]
    remote = engine_kwargs(remote_cache_url=server.url)
    for engine in ("A", "B"):
        llm = make_engine(gemma, "kvbackend", **ENGINE, disable_log_stats=False, **remote)
        try:
            before = cached_by_source(llm)
            got = [run(llm, [p])[0] for p in prompts]  # one at a time: B loads each
            assert [o.outputs[0].token_ids for o in got] == want, engine
            gained = sum(v - before.get(k, 0) for k, v in cached_by_source(llm).items())
        finally:
            shutdown(llm)  # A: the connector's shutdown sends what is still queued
        if engine == "A":
            shared = 2 * (len(system) // BLOCK_SIZE)  # the system prompt's, written once
            assert server.client().dbsize() >= sum(aligned) // BLOCK_SIZE - shared
        else:
            assert [o.num_cached_tokens for o in got] == aligned
            assert gained >= sum(aligned) - 2 * len(system), gained  # the rest: device
    raw = server.client()
    for name in raw.scan_iter("kvb:*"):  # one flipped payload bit in every value
        value = bytearray(raw.get(name))
        value[-1] ^= 1
        raw.set(name, bytes(value))
    llm = make_engine(gemma, "kvbackend", **ENGINE, **remote)
    try:
        (got,) = run(llm, prompts[3:])
    finally:
        shutdown(llm)
    assert got.outputs[0].token_ids == want[3] and got.num_cached_tokens == 0
