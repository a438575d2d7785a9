"""Real vLLM (CPU build) engines on a tiny random Llama built locally.

Engines start in 20-40 s each on this machine, so each is session-scoped and
shared by every test module that asks for it.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

from kvbackend.testing.tiny_model import build_tiny_llama  # noqa: E402
from kvbackend.vllm import engine_kwargs  # noqa: E402

BLOCK_SIZE = 32  # the smallest block the CPU attention backend accepts
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def engine_args(model: str, mode: str, **overrides) -> dict:
    """``vllm.LLM``'s keyword arguments for ``make_engine``."""
    kwargs = dict(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                  block_size=BLOCK_SIZE, kv_cache_memory_bytes=32 << 20, seed=0)
    if mode == "kvbackend":
        kwargs.update(engine_kwargs())
    else:
        kwargs["enable_prefix_caching"] = mode == "vllm-apc"
    kwargs.update(overrides)
    return kwargs


def make_engine(model: str, mode: str, **overrides):
    """``mode``: "kvbackend", "vllm-apc" (vLLM's own prefix caching) or "no-cache"."""
    return vllm.LLM(**engine_args(model, mode, **overrides))


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def print_results(got, **fields) -> None:
    """One JSON line: ``fields``, then the greedy outputs and cached tokens of the request
    outputs ``got`` (what a script run in a fresh interpreter hands back to its test)."""
    print(json.dumps({**fields, "outputs": [list(g.outputs[0].token_ids) for g in got],
                      "cached": [g.num_cached_tokens for g in got]}))


def generate(llm, prompts, params) -> list:
    """``llm``'s outputs for the token-id ``prompts``, in order."""
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def random_tokens(rng, n: int) -> list[int]:
    """``n`` token ids drawn from ``rng`` (``random.Random``), clear of special ids."""
    return [rng.randrange(3, 512) for _ in range(n)]


def block_hasher(block_size: int = BLOCK_SIZE):
    """vLLM's request block hasher, as its engine core makes one whenever a KV connector
    runs (a connector's tables hash the blocks taken from the cache with it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def greedy_outputs(llm, prompts, params) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's output token ids from ``llm``, keyed by the prompt's token tuple."""
    outs = generate(llm, prompts, params)
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}


def cached_by_source(llm) -> dict[str, float]:
    """vLLM's ``prompt_tokens_cached_by_source`` counters (needs stats on), per source."""
    return {m.labels["source"]: m.value for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"}


def cached_since(llm, before: dict[str, float]) -> dict[str, float]:
    """The sources whose ``cached_by_source`` count grew since ``before`` (an earlier
    reading), with the tokens each gained."""
    return {s: n - before.get(s, 0) for s, n in cached_by_source(llm).items()
            if n != before.get(s, 0)}


def assert_one_request_failed_a_damaged_load(capfd) -> None:
    """The engine's logs since the last ``capfd.readouterr()``: a damaged tier file was
    dropped, and exactly one request was recomputed whole for it (several KV-cache
    groups: vLLM takes a failed load only per request)."""
    logs = capfd.readouterr()
    logs = logs.out + logs.err
    assert "dropping bad block file" in logs
    assert logs.count("its tier hit failed to load; the request is recomputed") == 1


def numba_modules_after(code: str) -> str:
    """The numba/llvmlite modules a fresh interpreter has loaded after running ``code``
    (printed as a sorted list: "[]" for none)."""
    script = (code + "\nimport sys\nprint(sorted(m for m in sys.modules"
              " if m.split('.')[0] in ('numba', 'llvmlite')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="session")
def kvbackend_llm(tiny_model):
    # A small token budget forces chunked prefill of every long prompt.
    llm = make_engine(tiny_model, "kvbackend", max_num_batched_tokens=256)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def reference_llm(tiny_model):
    """vLLM with prefix caching off: the ground truth for greedy outputs."""
    llm = make_engine(tiny_model, "no-cache")
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def apc_llm(tiny_model):
    """vLLM with its own (block-granular, hash-based) prefix caching."""
    llm = make_engine(tiny_model, "vllm-apc")
    yield llm
    shutdown(llm)
