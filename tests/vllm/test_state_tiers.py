"""kvbackend's host and disk tiers serving a Mamba / linear-attention hybrid: the tiny
Qwen3-Next of ``test_state_hybrid.py`` (one Gated DeltaNet layer, one attention layer;
bfloat16; 288-token blocks), with a 2048-token prefill budget, so a 900-token prompt is
prefilled in two chunks, ending on 864 and 900: only the block ending on 864 holds the
state after its last token.

A block's ordinary tier copy holds its attention page only, its checkpoint copy
(``checkpoint_key``) both groups' pages; a hit must end on a block saved as a state
checkpoint and resumes from the state that copy holds. A hit that resumed from any
other state would change the greedy outputs, which match vLLM without caching, run
with the same chunks (one prompt at a time).
"""

from __future__ import annotations

import glob
import os
import random
import time

import pytest
from vllm import SamplingParams

from kvbackend.store import checkpoint_key, compute_block_keys
from kvbackend.store.block_file import HEADER_LEN
from kvbackend.store.layout import FORMAT_DIR, block_path
from kvbackend.vllm import engine_kwargs
from tests.redis_server import server  # noqa: F401 - the module's server
from tests.store_helpers import damage_file
from tests.vllm.conftest import (
    assert_one_request_failed_a_damaged_load, cached_by_source, generate, make_engine, shutdown,
)
from tests.vllm.conftest import random_tokens as tokens
from tests.vllm.test_state_hybrid import GREEDY, KV_BYTES, STATE_BLOCK, qwen3_next  # noqa: F401

ENGINE = dict(dtype="bfloat16", kv_cache_memory_bytes=KV_BYTES, mamba_ssm_cache_dtype="bfloat16",
              max_num_batched_tokens=2048)
PAGE = 73728  # bytes of a block of one group (its one layer)
HOST_GB = 64 * 2 * PAGE / (1 << 30)  # 64 whole tier blocks (one page per group)


@pytest.fixture(scope="module")
def ref(qwen3_next):  # noqa: F811
    llm = make_engine(qwen3_next, "no-cache", **ENGINE)
    yield llm
    shutdown(llm)


def _one(llm, prompt: list[int]):
    (got,) = generate(llm, [prompt], GREEDY)
    return got


def _gained(llm, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in cached_by_source(llm).items()
            if v != before.get(k, 0)}


def _files(directory, first: list[int]) -> tuple[list[str], list[str]]:
    """The paths of ``first``'s whole blocks in the disk tier, and of their checkpoint
    copies (the block keys name the identity, whose digest names the directory)."""
    (base,) = glob.glob(os.path.join(str(directory), FORMAT_DIR, "*", ""))
    keys = compute_block_keys(first, STATE_BLOCK, os.path.basename(base.rstrip("/")))
    return ([block_path(base, k) for k in keys],
            [block_path(base, checkpoint_key(k)) for k in keys])


def test_tier_hits_resume_from_state_checkpoints_only(  # noqa: F811
        qwen3_next, ref, tmp_path, capfd):
    """Engine A (host + disk tiers) prefills a 900-token prompt: all three whole blocks
    are saved (their attention pages), and only the third also as a checkpoint (both
    pages). With the device cache dropped:
    a prompt sharing two whole blocks gets no tier hit (neither holds a state; its own
    prefill leaves one on the second), the conversation's next turn loads 864 tokens
    from host and resumes from the saved state. Engine B, a new process on the same
    directory, loads them from disk; with the third block's checkpoint file damaged,
    the load fails, and the retry resumes from the second block's. Outputs match vLLM
    without caching throughout."""
    rng = random.Random(31)
    first = tokens(rng, 900)
    branch = first[:700] + tokens(rng, 50)
    disk = dict(disk_cache_dir=str(tmp_path))
    llm = make_engine(qwen3_next, "kvbackend", **ENGINE, disable_log_stats=False,
                      **engine_kwargs(host_cache_gb=HOST_GB, **disk))
    try:
        answer = _one(llm, first)
        assert answer.outputs[0].token_ids == _one(ref, first).outputs[0].token_ids
        turn = first + list(answer.outputs[0].token_ids) + tokens(rng, 40)
        blocks, checkpoints = _files(tmp_path, first)
        assert all(map(os.path.exists, blocks))
        assert [os.path.exists(c) for c in checkpoints] == [False, False, True]
        assert [os.path.getsize(f) - HEADER_LEN for f in [*blocks, checkpoints[2]]] == [
            PAGE, PAGE, PAGE, 2 * PAGE]

        assert llm.reset_prefix_cache()
        got = _one(llm, branch)
        assert got.outputs[0].token_ids == _one(ref, branch).outputs[0].token_ids
        assert got.num_cached_tokens == 0  # two whole blocks in the tiers, no checkpoint
        # its own first chunk ended on 576: now the second block holds one too
        assert [os.path.exists(c) for c in checkpoints] == [False, True, True]

        assert llm.reset_prefix_cache()
        before = cached_by_source(llm)
        got = _one(llm, turn)
        want = _one(ref, turn).outputs[0].token_ids
        assert got.outputs[0].token_ids == want
        assert got.num_cached_tokens == 3 * STATE_BLOCK
        assert _gained(llm, before) == {"host": 3 * STATE_BLOCK}
    finally:
        shutdown(llm)

    llm = make_engine(qwen3_next, "kvbackend", **ENGINE, **engine_kwargs(**disk))  # B
    try:
        got = _one(llm, turn)
        assert got.outputs[0].token_ids == want
        assert got.num_cached_tokens == 3 * STATE_BLOCK  # from disk
        assert llm.reset_prefix_cache()
        damage_file(checkpoints[2], rot=True)
        capfd.readouterr()
        got = _one(llm, turn)
        assert got.outputs[0].token_ids == want
        # The load failed, the request is recomputed; its retry resumes from the
        # checkpoint the branch left at 576.
        assert got.num_cached_tokens == 2 * STATE_BLOCK
    finally:
        shutdown(llm)
    assert_one_request_failed_a_damaged_load(capfd)


def test_a_retained_context_keeps_its_checkpoint_in_the_host_tier(qwen3_next, ref):  # noqa: F811
    """A host tier of 16 pages, 8 of them retained at most (a block's ordinary copy takes
    one, its checkpoint copy two): a 900-token prompt with ``kv_retain_s`` leaves its
    three blocks and its checkpoint copy there (5 pages), three unrelated prompts then
    fill it (15 more), and with the device cache dropped the conversation's next turn
    still loads 864 tokens from host (as ordinary keys its copies went first: no hit
    at all)."""
    rng = random.Random(5)
    first = tokens(rng, 900)
    keep = SamplingParams(temperature=0, max_tokens=16, extra_args={"kv_retain_s": 600})
    llm = make_engine(qwen3_next, "kvbackend", **ENGINE, disable_log_stats=False,
                      **engine_kwargs(host_cache_gb=HOST_GB / 8))
    try:
        (answer,) = generate(llm, [first], keep)
        turn = first + list(answer.outputs[0].token_ids) + tokens(rng, 40)
        generate(llm, [tokens(rng, 900) for _ in range(3)], GREEDY)
        assert llm.reset_prefix_cache()
        before = cached_by_source(llm)
        got = _one(llm, turn)
        assert got.outputs[0].token_ids == _one(ref, turn).outputs[0].token_ids
        assert _gained(llm, before) == {"host": 3 * STATE_BLOCK}
    finally:
        shutdown(llm)


def test_a_checkpoint_in_the_remote_tier_is_found_and_resumed_from(  # noqa: F811
        qwen3_next, ref, server):
    """The remote tier alone: the 900-token prompt writes its three blocks and the third
    one's checkpoint copy through to the server; with the device cache dropped, the
    next turn loads 864 tokens from it (one round trip for the blocks, one for the
    checkpoint copies) and resumes from that state."""
    rng = random.Random(8)
    first = tokens(rng, 900)
    llm = make_engine(qwen3_next, "kvbackend", **ENGINE, disable_log_stats=False,
                      **engine_kwargs(remote_cache_url=server.url))
    try:
        answer = _one(llm, first)
        assert answer.outputs[0].token_ids == _one(ref, first).outputs[0].token_ids
        deadline = time.monotonic() + 30  # the writes go out from a background thread
        while server.client().dbsize() < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        client = server.client()
        assert client.dbsize() == 4  # three blocks, one checkpoint copy
        assert sorted(client.strlen(k) - HEADER_LEN for k in client.keys()) == [
            PAGE, PAGE, PAGE, 2 * PAGE]
        turn = first + list(answer.outputs[0].token_ids) + tokens(rng, 40)
        assert llm.reset_prefix_cache()
        before = cached_by_source(llm)
        got = _one(llm, turn)
        assert got.outputs[0].token_ids == _one(ref, turn).outputs[0].token_ids
        assert got.num_cached_tokens == 3 * STATE_BLOCK
        assert _gained(llm, before) == {"external_unspecified": 3 * STATE_BLOCK}  # remote
    finally:
        shutdown(llm)
