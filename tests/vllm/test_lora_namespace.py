"""A LoRA adapter's cached KV is reused only under the same adapter *content*.

vLLM's CPU build serves LoRA, so the real engine runs here with tiny random adapters
for the tiny Llama (``kvbackend.testing.tiny_lora``) that change ``k_proj``/``v_proj``:
an adapter's KV differs from another's for the same tokens. Two engines: kvbackend
with a host tier, and vLLM without any cache (the reference for greedy outputs).
"""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest

from kvbackend.testing.tiny_lora import build_tiny_lora
from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.namespace import AdapterKeys, namespace_bytes
from tests.vllm.conftest import make_engine, shutdown

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
PROMPT_LEN = 200


@pytest.fixture(scope="module")
def lora_llm(tiny_model):
    llm = make_engine(tiny_model, "kvbackend", max_model_len=1024, **LORA,
                      **engine_kwargs(host_cache_gb=0.02))
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def lora_reference(tiny_model):
    llm = make_engine(tiny_model, "no-cache", max_model_len=1024, **LORA)
    yield llm
    shutdown(llm)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]


def _run(llm, prompt: list[int], lora: LoRARequest):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora,
                          use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _check(lora_llm, lora_reference, prompt, lora) -> int:
    """Run on both engines; outputs must match; return kvbackend's cached tokens."""
    tokens, cached = _run(lora_llm, prompt, lora)
    assert tokens == _run(lora_reference, prompt, lora)[0], lora
    return cached


def test_a_name_pointed_at_other_weights_reuses_nothing(lora_llm, lora_reference,
                                                        tiny_model, tmp_path):
    first = build_tiny_lora(str(tmp_path / "a"), tiny_model, seed=1)
    second = build_tiny_lora(str(tmp_path / "b"), tiny_model, seed=2)
    prompt = _prompt(1)
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("ad", 1, first)) == 0
    assert _check(lora_llm, lora_reference, prompt,
                  LoRARequest("ad", 1, first)) == PROMPT_LEN - 1  # the adapter itself hits
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("ad", 2, second)) == 0


def test_an_adapter_rewritten_at_its_path_reuses_nothing(lora_llm, lora_reference,
                                                         tiny_model, tmp_path):
    path = build_tiny_lora(str(tmp_path / "c"), tiny_model, seed=3)
    prompt = _prompt(2)
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("c", 3, path)) == 0
    # Unload, new weights at the same path, load again: vLLM gives it a new id.
    build_tiny_lora(path, tiny_model, seed=4)
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("c", 4, path)) == 0
    # In-place reload: same name, id and path, new weights.
    build_tiny_lora(path, tiny_model, seed=5)
    assert _check(lora_llm, lora_reference, prompt,
                  LoRARequest("c", 4, path, load_inplace=True)) == 0


def test_the_host_tier_keeps_adapters_apart(lora_llm, lora_reference, tiny_model, tmp_path):
    first = build_tiny_lora(str(tmp_path / "d"), tiny_model, seed=6)
    other = build_tiny_lora(str(tmp_path / "e"), tiny_model, seed=7)
    prompt = _prompt(3)
    full_blocks = (PROMPT_LEN - 1) // 32 * 32
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("tier", 6, first)) == 0
    assert lora_llm.reset_prefix_cache()  # the device tree only; the host tier keeps its blocks
    assert _check(lora_llm, lora_reference, prompt,
                  LoRARequest("tier", 6, first)) == full_blocks  # from the host tier
    assert lora_llm.reset_prefix_cache()
    assert _check(lora_llm, lora_reference, prompt, LoRARequest("tier", 7, other)) == 0


def test_adapter_keys_follow_the_files(tiny_model, tmp_path):
    keys = AdapterKeys()
    path = build_tiny_lora(str(tmp_path / "f"), tiny_model, seed=8)
    same = build_tiny_lora(str(tmp_path / "g"), tiny_model, seed=8)
    key = keys.key(LoRARequest("f", 1, path))
    assert key == keys.key(LoRARequest("f", 9, path))  # the id does not matter, content does
    assert key[2] == keys.key(LoRARequest("f", 1, same))[2]  # same content elsewhere
    build_tiny_lora(path, tiny_model, seed=9)  # same sizes, other bytes
    rewritten = keys.key(LoRARequest("f", 1, path))
    assert rewritten != key and namespace_bytes((rewritten, None)) != namespace_bytes((key, None))
    missing = keys.key(LoRARequest("f", 1, str(tmp_path / "nowhere")))
    assert missing[:3] == ("f", str(tmp_path / "nowhere"), 1)
    assert missing[3].startswith("unverified-")
