"""The tiers' identity covers everything that changes the KV bytes of the same tokens.

Each configuration is vLLM's own ``VllmConfig`` (``EngineArgs.create_engine_config``)
for the tiny Llama, plus a ``KVCacheConfig`` as the engine core hands it to the
scheduler and the workers. Every change listed must change the digest; a change
that does not touch the bytes (``max_model_len``) must not; and the same
configuration gives the same digest in another process (other hash seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvbackend.testing.tiny_model import build_tiny_dflash, build_tiny_llama
from kvbackend.vllm.tier_identity import block_nbytes, tier_identity
from tests.vllm.conftest import BLOCK_SIZE

BASE = {"dtype": "bfloat16", "max_model_len": 512, "block_size": BLOCK_SIZE}
LINEAR_ROPE = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
# name -> (engine arguments over BASE, KV cache layout)
CHANGES = {
    "hf_overrides: RoPE scaling": ({"hf_overrides": LINEAR_ROPE}, "LBHNC"),
    "hf_overrides: RoPE theta": (
        {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}},
        "LBHNC"),
    "online quantization": ({"quantization": "fp8"}, "LBHNC"),
    "fp8 KV cache": ({"kv_cache_dtype": "fp8"}, "LBHNC"),
    "model dtype": ({"dtype": "float32"}, "LBHNC"),
    "dummy weights": ({"load_format": "dummy"}, "LBHNC"),
    "block size": ({"block_size": 2 * BLOCK_SIZE}, "LBHNC"),
    "KV layout (stride order)": ({}, "LBNHC"),
}


def _kv_cache_config(vllm_config, layout: str) -> KVCacheConfig:
    """The single full-attention group the engine core builds for the tiny Llama."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else torch.float8_e4m3fn
    spec = FullAttentionSpec(block_size=cache.block_size,
                             num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(
        vllm_config.parallel_config))]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
                         kv_cache_layout=layout)


def digest(model: str, changes: dict, layout: str = "LBHNC", tp_rank: int = 0) -> str:
    config = EngineArgs(model=model, **{**BASE, **changes}).create_engine_config()
    return tier_identity(config, _kv_cache_config(config, layout), tp_rank=tp_rank).digest()


@pytest.fixture(scope="module")
def base_digest(tiny_model) -> str:
    return digest(tiny_model, {})


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_change_of_the_kv_bytes_changes_the_digest(tiny_model, base_digest, name):
    changes, layout = CHANGES[name]
    assert digest(tiny_model, changes, layout) != base_digest


def test_a_copy_of_the_model_elsewhere_has_the_same_identity(tiny_model, tmp_path, base_digest):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(tiny_model):
        if os.path.isfile(os.path.join(tiny_model, name)):
            os.link(os.path.join(tiny_model, name), copy / name)
    assert digest(str(copy), {}) == base_digest


def test_what_does_not_change_the_bytes_keeps_the_digest(tiny_model, base_digest):
    assert digest(tiny_model, {"max_model_len": 1024}) == base_digest
    assert digest(tiny_model, {"seed": 7}) == base_digest


def test_the_same_configuration_gives_the_same_digest_in_another_process(tiny_model,
                                                                         base_digest):
    script = ("import json, sys\n"
              "from tests.vllm.test_tier_identity import CHANGES, digest\n"
              "model = sys.argv[1]\n"
              "out = {name: digest(model, *CHANGES[name]) for name in CHANGES}\n"
              "out['base'] = digest(model, {})\n"
              "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", script, tiny_model], capture_output=True,
                          text=True, timeout=600, env=env, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs.pop("base") == base_digest
    assert theirs == {name: digest(tiny_model, *CHANGES[name]) for name in CHANGES}


def test_the_kv_cache_groups_are_part_of_the_identity(tiny_model, base_digest):
    """A payload holds one block of every group, in group order: blocks written with one
    group layout (vLLM's hybrid manager off, or another split or order of the layers)
    are never read with another, although the payloads have the same size."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    config = EngineArgs(model=tiny_model, **BASE).create_engine_config()
    one = _kv_cache_config(config, "LBHNC")
    (group,) = one.kv_cache_groups
    spec = group.kv_cache_spec
    window = SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                               head_size=spec.head_size, dtype=spec.dtype, sliding_window=64)

    def layout(*groups) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_layout="LBHNC",
                             kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in groups])

    first, second = group.layer_names
    layouts = [one, layout((first, spec), (second, window)),
               layout((second, window), (first, spec)), layout((first, spec), (second, spec))]
    digests = [tier_identity(config, c, tp_rank=0).digest() for c in layouts]
    assert digests[0] == base_digest and len(set(digests)) == len(layouts)
    assert len({block_nbytes(c) for c in layouts}) == 1


def test_a_drafter_that_writes_kv_is_part_of_the_identity(tiny_model, tmp_path, base_digest):
    """A draft model's layers (and EAGLE / MTP / DFlash heads) write KV into the same
    blocks as the target's: blocks written with one drafter are never read with another,
    although both have the same architecture (same layout). A drafter without KV (n-gram)
    keeps the digest, and a copy of the drafter elsewhere reads the same blocks."""
    drafts = [build_tiny_llama(str(tmp_path / f"draft-{seed}"), seed=seed) for seed in (1, 2)]

    def with_drafter(spec: dict) -> str:
        return digest(tiny_model, {"speculative_config": spec})

    def draft_model(path: str) -> str:
        return with_drafter({"method": "draft_model", "model": path,
                             "num_speculative_tokens": 3})

    first, second = draft_model(drafts[0]), draft_model(drafts[1])
    assert len({base_digest, first, second}) == 3
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(drafts[0]):
        if os.path.isfile(os.path.join(drafts[0], name)):
            os.link(os.path.join(drafts[0], name), copy / name)
    assert draft_model(str(copy)) == first
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert with_drafter(ngram) == base_digest
    # the same DFlash weights, drafting bidirectionally or causally: other drafter KV
    dflash = [with_drafter({"method": "dflash", "num_speculative_tokens": 3,
                            "model": build_tiny_dflash(str(tmp_path / f"dflash-{c}"), causal=c)})
              for c in (False, True)]
    assert len({base_digest, *dflash}) == 3
