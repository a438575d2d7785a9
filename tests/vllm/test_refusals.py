"""Models whose prefix KV kvbackend cannot reuse correctly are refused at start.

A prefix-LM model (the prompt attends bidirectionally: the KV of a prompt's prefix
depends on the rest of the prompt) is started for real on the CPU engine, in a
subprocess, and must exit with kvbackend's message. A diffusion model cannot start
on the CPU build at all (its V1 model runner refuses them), so its refusal is
checked on vLLM's real config and scheduler: the configuration a GPU build would
hand to kvbackend's scheduler.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
    SinkFullAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.scheduler import (
    MIXED_BLOCK_SIZES_REFUSAL, STATE_LAYERS_REFUSAL, UNCHECKED_DRAFTERS_REFUSAL,
    UNCHECKED_LAYERS_REFUSAL, KVBackendScheduler, unsupported_features,
)
from tests.vllm.conftest import BLOCK_SIZE
from tests.vllm.test_other_connectors import example_connector

REFUSED = "kvbackend cannot serve this configuration"
START_TIMEOUT_S = 300


def _copy_tokenizer(src: str, dst: str) -> None:
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(src, name), dst)


@pytest.fixture(scope="module")
def prefix_lm_model(tiny_model, tmp_path_factory) -> str:
    """A tiny random HRM-Text model: vLLM runs its prompt with prefix-LM attention."""
    from transformers import HrmTextConfig, HrmTextForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-hrm"))
    config = HrmTextConfig(vocab_size=512, hidden_size=128, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=4, head_dim=32, H_cycles=1,
                           L_cycles=1, max_position_embeddings=2048, bos_token_id=1,
                           eos_token_id=2)
    assert config.prefix_lm
    torch.manual_seed(0)
    HrmTextForCausalLM(config).eval().save_pretrained(path)
    _copy_tokenizer(tiny_model, path)
    return path


@pytest.fixture(scope="module")
def diffusion_model(tiny_model, tmp_path_factory) -> str:
    """The tiny Llama with a ``canvas_length``: what makes vLLM treat a model as diffusion."""
    path = str(tmp_path_factory.mktemp("tiny-diffusion"))
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "canvas_length": 64}, f)
    return path


START_SCRIPT = """
import sys
from vllm import LLM
from kvbackend.vllm import engine_kwargs
if __name__ == "__main__":
    LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=512, enforce_eager=True,
        block_size=32, kv_cache_memory_bytes=8 << 20, **engine_kwargs())
    print("STARTED")
"""


def _start_refusal(model: str, dtype: str, tmp_path) -> str:
    """Start a kvbackend engine on ``model`` in a fresh interpreter, which must fail;
    return the line of kvbackend's refusal in its stderr."""
    script = tmp_path / "start.py"
    script.write_text(START_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([sys.executable, str(script), model, dtype], capture_output=True,
                          text=True, timeout=START_TIMEOUT_S, env=env, cwd=os.getcwd())
    assert "STARTED" not in done.stdout
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if f"ValueError: {REFUSED}" in line]
    assert refusals, done.stderr[-3000:]
    return refusals[-1]


def test_prefix_lm_model_is_refused_at_start(prefix_lm_model, tmp_path):
    assert "non-causal" in _start_refusal(prefix_lm_model, "float32", tmp_path)



def _kv_cache_config(num_layers: int = 2) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def test_diffusion_model_is_refused_by_the_scheduler(diffusion_model, monkeypatch):
    # Diffusion models are served by the V2 model runner, which needs Triton (GPU builds):
    # let the config validation see the GPU build's answer to "is Triton there".
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr("vllm.config.vllm.HAS_TRITON", True)
    config = EngineArgs(model=diffusion_model, dtype="float32", max_model_len=512,
                        block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()
    assert config.model_config.is_diffusion
    assert config.scheduler_config.scheduler_cls == engine_kwargs()["scheduler_cls"]
    assert unsupported_features(config) == ["diffusion models (they need vLLM's "
                                            "DiffusionScheduler)"]
    kv_cache_config = _kv_cache_config()
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as EngineCore does
    with pytest.raises(ValueError, match=f"{REFUSED}: diffusion models"):
        KVBackendScheduler(config, kv_cache_config, StructuredOutputManager(config),
                           block_size=BLOCK_SIZE)


def test_non_causal_specs_are_refused(tiny_model):
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                        block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()
    causal = _kv_cache_config()
    assert unsupported_features(config, causal) == []
    group = causal.kv_cache_groups[0]
    bidirectional = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32,
                                      dtype=torch.float32, non_causal=True)
    non_causal = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(group.layer_names, bidirectional)])
    assert unsupported_features(config, non_causal) == [
        "non-causal (bidirectional or prefix-LM) attention"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def _spec_config(tiny_model, speculative_config, **overrides):
    return EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                      block_size=BLOCK_SIZE, speculative_config=speculative_config,
                      **{**engine_kwargs(), **overrides}).create_engine_config()


def test_ngram_speculative_decoding_is_served_without_the_option_validator(tiny_model):
    """vLLM's workers refuse any custom logits processor under speculative decoding:
    kvbackend's option validator leaves the configuration then (and only then)."""
    from kvbackend.vllm import OPTIONS_VALIDATOR
    from kvbackend.vllm.plugin import register

    register()
    config = _spec_config(tiny_model, NGRAM)
    assert unsupported_features(config, _kv_cache_config()) == []
    assert OPTIONS_VALIDATOR not in (config.model_config.logits_processors or [])
    plain = _spec_config(tiny_model, None)
    assert OPTIONS_VALIDATOR in plain.model_config.logits_processors


def test_draft_models_eagle_and_dflash_are_served_with_async_scheduling_others_refused(
        tiny_model):
    draft = {"model": tiny_model, "num_speculative_tokens": 2}
    for method in ("draft_model", "eagle"):  # run in test_spec_decode.py
        config = _spec_config(tiny_model, {"method": method, **draft})
        assert unsupported_features(config) == []
        config.scheduler_config.async_scheduling = True  # what vLLM picks on a GPU
        assert unsupported_features(config) == []  # test_async_scheduling.py: drafts
    config.speculative_config.method = "dflash"  # run in test_spec_decode.py too
    assert unsupported_features(config) == []
    for method in ("dspark", "extract_hidden_states"):  # not run on the CPU build
        config.speculative_config.method = method
        assert unsupported_features(config) == [UNCHECKED_DRAFTERS_REFUSAL]


def _spec(kind, block_size: int = BLOCK_SIZE, **fields):
    return kind(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32,
                **fields)


def _groups_config(*specs, num_blocks: int = 64) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
        for i, spec in enumerate(specs)])


def test_state_layers_and_mixed_block_sizes_are_refused(tiny_model, tmp_path):
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                        block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()
    window = _spec(SlidingWindowSpec, sliding_window=64)
    assert unsupported_features(config, _groups_config(_spec(FullAttentionSpec), window)) == []
    for mamba_block_size in (BLOCK_SIZE, 512):  # mode "none": one block of max_model_len
        mamba = MambaSpec(block_size=mamba_block_size, shapes=((4, 32),),
                          dtypes=(torch.float32,))
        assert unsupported_features(config, _groups_config(_spec(FullAttentionSpec), mamba)) == [
            STATE_LAYERS_REFUSAL]
    for mamba_block_size, refused in ((BLOCK_SIZE, []),
                                      (2 * BLOCK_SIZE, [MIXED_BLOCK_SIZES_REFUSAL])):
        mamba = MambaSpec(block_size=mamba_block_size, shapes=((4, 32),),
                          dtypes=(torch.float32,), mamba_cache_mode="align")
        assert unsupported_features(
            config, _groups_config(_spec(FullAttentionSpec), mamba)) == refused
    # Gemma 4's shape (test_mixed_block_sizes.py): served alone and with kvbackend's tiers,
    # refused with what moves or announces one block per group and logical block
    wide = _groups_config(_spec(FullAttentionSpec),
                          _spec(SlidingWindowSpec, 2 * BLOCK_SIZE, sliding_window=64))
    assert unsupported_features(config, wide) == []
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    assert unsupported_features(config, wide) == [MIXED_BLOCK_SIZES_REFUSAL]
    for transfer, refused in (({"host_cache_gb": 1}, []),
                              ({"kv_transfer_config": example_connector(str(tmp_path))},
                               [MIXED_BLOCK_SIZES_REFUSAL])):
        composed = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                              block_size=BLOCK_SIZE,
                              **engine_kwargs(**transfer)).create_engine_config()
        assert unsupported_features(composed, wide) == refused


def test_mixed_block_sizes_need_a_max_model_len_of_whole_logical_blocks(tiny_model):
    """vLLM sizes each group's block table to ``max_model_len`` over its block size: a
    logical block of the largest size must not run past it."""
    wide = _groups_config(_spec(FullAttentionSpec),
                          _spec(SlidingWindowSpec, 2 * BLOCK_SIZE, sliding_window=64))
    for max_model_len, refused in ((512, False), (480, True)):
        config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=max_model_len,
                            block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()
        config.cache_config.num_gpu_blocks = wide.num_blocks  # as EngineCore does
        start = lambda: KVBackendScheduler(  # noqa: E731
            config, wide, StructuredOutputManager(config), block_size=2 * BLOCK_SIZE)
        if refused:
            with pytest.raises(ValueError, match="multiple of the scheduler's block size"):
                start()
        else:
            start()


def test_groups_vllm_keeps_out_of_prefix_caching_and_static_sinks_are_refused(tiny_model):
    """DeepSeek-V4's layers vLLM replays after a hit or never caches, and OpenPangu's
    static sinks (GPU-only). Before: the replayed window and the sinks were served as
    plain attention, the circular buffer refused as state layers."""
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                        block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()
    unchecked = [_spec(SlidingWindowMLASpec, sliding_window=64, bounded_replay=True),
                 _spec(CircularBufferSpec), _spec(SinkFullAttentionSpec, sink_len=BLOCK_SIZE)]
    for spec in unchecked:
        assert unsupported_features(config, _groups_config(_spec(FullAttentionSpec), spec)) == [
            UNCHECKED_LAYERS_REFUSAL], spec
    plain_window = _spec(SlidingWindowMLASpec, sliding_window=64)  # no replay: a window
    assert unsupported_features(config, _groups_config(_spec(FullAttentionSpec),
                                                       plain_window)) == []


@pytest.mark.parametrize("num_blocks, batched, connector, refusal", [
    (64, 8192, None, None),
    (20, 8192, None, "needs 16 blocks in the full-attention group and up to 16 in the 1 "
                     "sliding-window groups, the KV cache holds 19"),
    (24, 64, None, None),
    (24, 64, "tiers", None),
    (24, 64, "other", "needs 16 blocks in each of the 2 groups, the KV cache holds 11"),
])
def test_several_groups_are_served_where_a_whole_request_fits(tiny_model, tmp_path, num_blocks,
                                                              batched, connector, refusal):
    """A 512-token request takes 16 full-attention blocks (32 tokens each). Without a KV
    connector, or with kvbackend's tiers only, its sliding-window pages (64-token window)
    are freed once out of the window, so it holds at most vLLM's admission cap of them:
    all 16 with 8192-token chunks, 4 with 64-token ones (cdiv(63 + 64, 32)), so 24 blocks
    serve it. With another connector every group keeps every block: 24 blocks over 2
    groups leave 11."""
    transfer = {"tiers": {"host_cache_gb": 0.01},
                "other": {"kv_transfer_config": example_connector(str(tmp_path))}}
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                        block_size=BLOCK_SIZE, max_num_batched_tokens=batched,
                        **engine_kwargs(**transfer.get(connector, {}))).create_engine_config()
    kv_cache_config = _groups_config(_spec(FullAttentionSpec),
                                     _spec(SlidingWindowSpec, sliding_window=64),
                                     num_blocks=num_blocks)
    config.cache_config.num_gpu_blocks = num_blocks

    def start():
        return KVBackendScheduler(config, kv_cache_config, StructuredOutputManager(config),
                                  block_size=BLOCK_SIZE)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            start()
    else:
        manager = start().kv_cache_manager
        assert manager.groups.num_groups == 2 and manager.windows is not None
