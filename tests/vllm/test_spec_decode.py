"""Speculative decoding with kvbackend on the real vLLM CPU engine: n-gram drafts, a draft
model (a tiny Llama of another seed: it rarely agrees, so most drafts are rejected),
EAGLE and EAGLE-3 drafters and a DFlash drafter (random too), whose KV after a hit
``drafter_kv.py`` checks.

kvbackend (its tree checked after every step for draft tokens, in a fresh process:
``spec_decode_steps.py``) against vLLM without prefix caching or speculative decoding
(greedy outputs) and vLLM's prefix caching with the same speculative decoding (hits).
The workload is repetitive, so n-gram proposes drafts and the model rejects some, and
conversations continue from decoded output, so hits cover blocks written while drafts
were being verified.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm import SamplingParams

from kvbackend.testing.tiny_model import (
    build_tiny_dflash, build_tiny_eagle, build_tiny_eagle3, build_tiny_llama, build_tiny_mimo,
)
from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown
from tests.vllm.spec_decode_steps import MAX_TOKENS, run_workload, speculative_config

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


# name: (speculative method, builder of the tiny drafter)
DRAFTERS = {"draft_model": ("draft_model", lambda path: build_tiny_llama(path, seed=1)),
            "eagle": ("eagle", build_tiny_eagle), "eagle3": ("eagle3", build_tiny_eagle3),
            "dflash": ("dflash", build_tiny_dflash),
            # a KV-cache group of its own: the drafter's window, next to the target's
            "dflash_window": ("dflash", lambda path: build_tiny_dflash(path, sliding_window=48))}


@pytest.fixture(scope="module", params=["ngram", *DRAFTERS])
def drafter(request, tmp_path_factory) -> tuple[str, str] | None:
    """None for n-gram drafts, else the drafter's (method, path)."""
    if request.param == "ngram":
        return None
    method, build = DRAFTERS[request.param]
    return method, build(str(tmp_path_factory.mktemp("tiny-drafter")))


@pytest.fixture(scope="module")
def kvbackend_run(tiny_model, drafter) -> dict:
    args = [tiny_model, *(drafter or ())]
    done = subprocess.run([sys.executable, "-m", "tests.vllm.spec_decode_steps", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def apc_spec_run(tiny_model, drafter):
    llm = make_engine(tiny_model, "vllm-apc", speculative_config=speculative_config(drafter))
    try:
        yield run_workload(llm, GREEDY)
    finally:
        shutdown(llm)


def test_drafts_are_proposed_and_some_rejected(kvbackend_run, drafter):
    assert 0 <= kvbackend_run["accepted"] < kvbackend_run["drafts"]
    if drafter is None:  # n-gram finds the repetitions: some drafts are accepted
        assert kvbackend_run["accepted"] > 0


def test_tree_holds_only_real_tokens_after_every_step(kvbackend_run):
    assert kvbackend_run["violations"] == []


def test_greedy_outputs_match_vllm_without_caching_or_drafts(kvbackend_run, reference_llm):
    prompts = kvbackend_run["prompts"]
    reference = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                       use_tqdm=False)
    assert kvbackend_run["outputs"] == [list(r.outputs[0].token_ids) for r in reference]


def test_hits_never_below_vllm_prefix_caching_with_the_same_drafts(kvbackend_run,
                                                                   apc_spec_run):
    prompts, outputs = apc_spec_run
    assert prompts == kvbackend_run["prompts"]  # the same outputs, so the same follow-ups
    theirs = [o.num_cached_tokens for o in outputs]
    assert sum(theirs) > 0, "vLLM's prefix caching hit nothing; the workload is wrong"
    assert all(ours >= t for ours, t in zip(kvbackend_run["cached"], theirs)), (
        kvbackend_run["cached"], theirs)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_an_eagle_hit_keeps_the_drafter_kv_that_read_the_requests_own_next_token(tiny_model,
                                                                                tmp_path, method):
    """``drafter_kv.py``: B shares A's two-block document, then diverges. The drafter's KV
    at the document's last token read A's next token, so B's hit stops one token short
    and B's copy of that block holds, in the drafter's layer, what a request computing B
    from scratch holds (and in the target's layers what A's holds). MTP: a tiny MiMo's
    own MTP layer drafts."""
    if method == "mtp":
        got = _drafter_kv(build_tiny_mimo(str(tmp_path / "mimo")), method)
    else:
        got = _drafter_kv(tiny_model, method, DRAFTERS[method][1](str(tmp_path / method)))
    assert got["drafter_b_vs_fresh"] < 1e-5
    assert got["drafter_b_vs_a"] > 1e-3, "B's drafter KV is A's: it read A's next token"


@pytest.mark.parametrize("causal", [False, True])
def test_a_dflash_hit_holds_the_drafter_kv_a_fresh_request_computes(tiny_model, tmp_path,
                                                                   causal):
    """``drafter_kv.py`` with a DFlash drafter, whose context K/V at a position is projected
    from the target's hidden states there (a function of the prefix), and whose block of
    draft queries (within it bidirectional, or causal) is written past the computed tokens.
    B's copy of the shared block then holds, in the drafter's layer, what A's and what a
    request computing B from scratch hold. The hit still stops one token short: vLLM gives
    every drafter that reads the target's hidden states a prefill lookahead of one."""
    got = _drafter_kv(tiny_model, "dflash",
                      build_tiny_dflash(str(tmp_path / "dflash"), causal=causal))
    assert got["drafter_b_vs_fresh"] < 1e-5 and got["drafter_b_vs_a"] < 1e-5


def _drafter_kv(*args: str) -> dict:
    """``drafter_kv.py``'s report for ``args``, with what holds for every drafter checked:
    among it, a block loaded from the host tier holds in the drafter's layer what a fresh
    request computes (vLLM runs the connector's saves after the drafter's forward pass;
    taken before it, the drafter's slots of the step differed: 3.3 for DFlash, 0.67 for
    EAGLE)."""
    done = subprocess.run([sys.executable, "-m", "tests.vllm.drafter_kv", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # the third: another cache salt; the fourth: the second again, from the host tier (its
    # last whole block dropped: no tier key vouches for the next token)
    assert got["cached"] == [0, 2 * BLOCK_SIZE - 1, 0, BLOCK_SIZE]
    assert got["outputs"][1] == got["outputs"][2] == got["outputs"][3]
    assert got["num_drafter_layers"] == 1 and got["blocks"][1] != got["blocks"][0]
    assert got["target_b_vs_a"] < 1e-5
    # a tier block holds the drafter's KV too: saved once the drafter wrote it
    assert got["target_loaded_vs_fresh"] < 1e-5 and got["drafter_loaded_vs_fresh"] < 1e-5
    return got
