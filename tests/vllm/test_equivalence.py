"""kvbackend inside the real vLLM engine: outputs and hit lengths.

Every test compares greedy outputs token for token with vLLM running with
prefix caching off, and checks ``num_cached_tokens`` against a brute-force
model of what the engine has cached: every finished request leaves its prompt
and all output tokens but the last (whose KV was never computed) in the cache,
and a hit is the longest common prefix with any of those, capped at length - 1.
The kvbackend engine runs with a 256-token budget per step, so every prompt
longer than that is prefilled in chunks.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from vllm import SamplingParams

from tests.token_reference import lcp
from tests.vllm.conftest import BLOCK_SIZE

GREEDY = SamplingParams(temperature=0, max_tokens=6)


class CacheModel:
    """What the shared kvbackend engine has computed so far (nothing is evicted:
    the engine's KV cache holds far more than this module generates)."""

    def __init__(self):
        self.sequences: list[list[int]] = []

    def hit(self, prompt, batch=()):
        """(lowest, highest) legal hit: from earlier calls only, or also from
        prompts scheduled alongside in the same batch."""
        low = max((lcp(prompt, s) for s in self.sequences), default=0)
        high = max([low] + [lcp(prompt, other) for other in batch if other is not prompt])
        return min(low, len(prompt) - 1), min(high, len(prompt) - 1)

    def record(self, prompt, output):
        self.sequences.append(list(prompt) + list(output[:-1]))


@pytest.fixture(scope="module")
def model():
    return CacheModel()


def run(llm, prompts, params=GREEDY, salt=None):
    inputs = [{"prompt_token_ids": p} | ({"cache_salt": salt} if salt else {}) for p in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


def check_batch(kvb, ref, model, prompts, params=GREEDY, exact=True):
    """Run ``prompts`` as one batch on both engines; compare outputs and hits."""
    siblings = prompts + [list(p) for p in prompts] * (params.n > 1)  # n > 1: children share
    expected = [model.hit(p, siblings) for p in prompts]
    got = run(kvb, prompts, params)
    want = run(ref, prompts, params)
    for prompt, g, w, (low, high) in zip(prompts, got, want, expected):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert low <= g.num_cached_tokens <= high, (g.num_cached_tokens, low, high)
        if exact:
            assert g.num_cached_tokens == low == high
        for o in g.outputs:
            model.record(prompt, o.token_ids)
    return got


def tokens(rng, n, first=None):
    out = [rng.randrange(3, 512) for _ in range(n)]
    if first is not None:
        out[0] = first
    return out


def test_shared_system_prompt_ending_mid_block(kvbackend_llm, reference_llm, apc_llm, model):
    rng = random.Random(1)
    system = tokens(rng, 21 * BLOCK_SIZE + 28)  # ends 28 tokens into a block
    questions = [tokens(rng, 20 + i, first=10 + i) for i in range(7)]
    prompts = [system + q for q in questions]
    check_batch(kvbackend_llm, reference_llm, model, prompts[:1])
    got = check_batch(kvbackend_llm, reference_llm, model, prompts[1:])
    assert {o.num_cached_tokens for o in got} == {len(system)}
    run(apc_llm, prompts[:1])
    apc = run(apc_llm, prompts[1:])
    for ours, theirs in zip(got, apc):
        assert theirs.num_cached_tokens == len(system) // BLOCK_SIZE * BLOCK_SIZE
        assert ours.num_cached_tokens > theirs.num_cached_tokens


def test_multi_turn_conversation_reuses_every_previous_turn(kvbackend_llm, reference_llm, model):
    rng = random.Random(2)
    history = tokens(rng, 300)
    for turn in range(4):
        (out,) = check_batch(kvbackend_llm, reference_llm, model, [history])
        if turn:
            assert out.num_cached_tokens == previous - 1  # all but the last output token
        history = history + list(out.outputs[0].token_ids) + tokens(rng, 15)
        previous = len(history) - 15


def test_identical_prompts_hit_all_but_the_last_token(kvbackend_llm, reference_llm, model):
    rng = random.Random(3)
    prompt = tokens(rng, 5 * BLOCK_SIZE)
    check_batch(kvbackend_llm, reference_llm, model, [prompt])
    (again,) = check_batch(kvbackend_llm, reference_llm, model, [prompt])
    assert again.num_cached_tokens == len(prompt) - 1
    fresh = tokens(rng, 300)
    check_batch(kvbackend_llm, reference_llm, model, [fresh, list(fresh), list(fresh)], exact=False)


def test_prompt_that_is_a_prefix_of_another_and_the_reverse(kvbackend_llm, reference_llm, model):
    rng = random.Random(4)
    long = tokens(rng, 400)
    check_batch(kvbackend_llm, reference_llm, model, [long])
    (short,) = check_batch(kvbackend_llm, reference_llm, model, [long[:150]])
    assert short.num_cached_tokens == 149
    other = tokens(rng, 100)
    check_batch(kvbackend_llm, reference_llm, model, [other])
    (grown,) = check_batch(kvbackend_llm, reference_llm, model, [other + tokens(rng, 90)])
    assert grown.num_cached_tokens >= 100


@pytest.mark.parametrize("shared", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1,
                                    3 * BLOCK_SIZE + 17])
def test_hits_at_and_around_block_boundaries(kvbackend_llm, reference_llm, model, shared):
    rng = random.Random(100 + shared)
    base = tokens(rng, shared)
    check_batch(kvbackend_llm, reference_llm, model, [base + tokens(rng, 40, first=7)])
    (out,) = check_batch(kvbackend_llm, reference_llm, model, [base + tokens(rng, 40, first=8)])
    assert out.num_cached_tokens == shared


def test_parallel_sampling_shares_the_prompt(kvbackend_llm, reference_llm, model):
    rng = random.Random(5)
    prompt = tokens(rng, 200)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6)
    check_batch(kvbackend_llm, reference_llm, model, [prompt], params, exact=False)
    (out,) = check_batch(kvbackend_llm, reference_llm, model, [prompt], params, exact=False)
    assert out.num_cached_tokens == len(prompt) - 1


def test_cache_salts_never_share(kvbackend_llm, reference_llm):
    rng = random.Random(6)
    prompt = tokens(rng, 200)
    want = run(reference_llm, [prompt])[0].outputs[0].token_ids
    hits = {}
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        (out,) = run(kvbackend_llm, [prompt], salt=salt)
        assert out.outputs[0].token_ids == want
        hits.setdefault(salt, []).append(out.num_cached_tokens)
    assert hits == {"tenant-a": [0, len(prompt) - 1], "tenant-b": [0], None: [0]}


def test_branches_admitted_together_fall_back_to_the_older_partial_block(
        tiny_model, reference_llm):
    """Two branches of one conversation in one step: the second matches into the block
    the first is writing now, so it must fall back to the conversation's own partial
    block (written in an earlier step), not to the last full block."""
    done = subprocess.run([sys.executable, "-m", "tests.vllm.same_step_branches", tiny_model],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith('{"conversation"')]
    result = json.loads(line)
    want = run(reference_llm, result["prompts"])
    assert result["outputs"] == [list(w.outputs[0].token_ids) for w in want]
    assert result["cached"] == [len(result["conversation"])] * 2
