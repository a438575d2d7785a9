"""kvbackend serving a Mamba / linear-attention hybrid: a tiny Qwen3-Next (one Gated
DeltaNet layer, one full-attention layer; bfloat16, which the CPU build's GDN kernel
needs).

vLLM runs the GDN layer's state in ``mamba_cache_mode="align"`` and raises the block to
fit one state page (288 tokens here). A hit must resume from the state checkpointed at
its last token, which exists only where a step ended on a block boundary: a hit that
resumed from any other state block would change the greedy outputs, which match vLLM
without prefix caching. In bfloat16 the GDN layer's outputs depend on where prefill
chunks end (vLLM's own prefix caching differs from no caching with 256-token chunks),
so the engines prefill one block (288 tokens) per step, and the reference runs its
prompts one at a time: every engine then ends its chunks on the same block boundaries
(in "align" mode vLLM ends every chunk but a prompt's last on one). Each configuration
is one module-scoped engine.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
)

from kvbackend.testing.tiny_model import build_tiny_qwen3_next
from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.scheduler import STATE_LAYERS_REFUSAL, unsupported_features
from tests.token_reference import lcp
from tests.vllm.conftest import generate, make_engine, shutdown
from tests.vllm.conftest import random_tokens as tokens
from tests.vllm.test_other_connectors import example_connector

GREEDY = SamplingParams(temperature=0, max_tokens=16)
KV_BYTES = 64 << 20
STATE_BLOCK = 288  # tokens per block once vLLM fits a GDN state page in one


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    return build_tiny_qwen3_next(str(tmp_path_factory.mktemp("tiny-qwen3-next")))


def _engine(model: str, mode: str, **overrides):
    # A bfloat16 state on every CPU: where the CPU has AVX-512 BF16, vLLM otherwise keeps
    # it in float32 (for its accelerated GDN kernel) and the blocks grow to 544 tokens.
    llm = make_engine(model, mode, **{"dtype": "bfloat16", "kv_cache_memory_bytes": KV_BYTES,
                                      "mamba_ssm_cache_dtype": "bfloat16", **overrides})
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvb(qwen3_next):
    # One block per step: every block boundary a prompt passes is a step end.
    yield from _engine(qwen3_next, "kvbackend", max_num_batched_tokens=STATE_BLOCK)


@pytest.fixture(scope="module")
def ref(qwen3_next):
    yield from _engine(qwen3_next, "no-cache", max_num_batched_tokens=STATE_BLOCK)


@pytest.fixture(scope="module")
def apc(qwen3_next):
    yield from _engine(qwen3_next, "vllm-apc", max_num_batched_tokens=STATE_BLOCK)


def _block_size(llm) -> int:
    return llm.llm_engine.vllm_config.cache_config.block_size


def _outputs(got) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in got]


def _one_by_one(llm, prompts) -> list[list[int]]:
    """``llm``'s outputs with each prompt prefilled alone (its chunks end on blocks)."""
    return [_outputs(generate(llm, [p], GREEDY))[0] for p in prompts]


def test_kvbackend_runs_the_state_group_in_align_mode(kvb, qwen3_next):
    """The plugin turns vLLM's prefix-caching switch back on for a hybrid, so its workers
    keep state checkpoints; for an attention-only model it stays off."""
    cache = kvb.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching and cache.mamba_cache_mode == "align"
    assert _block_size(kvb) == STATE_BLOCK  # one GDN state page
    config = EngineArgs(model=qwen3_next, dtype="bfloat16", max_model_len=2048,
                        **engine_kwargs()).create_engine_config()
    assert config.cache_config.mamba_cache_mode == "align"


def test_hits_resume_from_state_checkpoints_and_outputs_match(kvb, ref, apc):
    """One request at a time, so each hit is exactly the longest cached prefix cut to a
    block boundary (every boundary a request passed holds its state): a shared system
    prompt, a conversation's next turn, a branch inside a block, a resend. Outputs match
    vLLM without caching; hits are never below vLLM's."""
    bs = _block_size(kvb)
    for llm in (kvb, apc):
        assert llm.reset_prefix_cache()
    rng = random.Random(5)
    system = tokens(rng, 700)
    first = system + tokens(rng, 200)
    cached: list[list[int]] = []  # every finished request leaves prompt + outputs[:-1]
    ours = theirs = 0

    def run(prompt: list[int]) -> list[int]:
        nonlocal ours, theirs
        expected = min(len(prompt) - 1, max((lcp(prompt, c) for c in cached), default=0))
        (got,), (want,), (base,) = (generate(llm, [prompt], GREEDY) for llm in (kvb, ref, apc))
        assert _outputs([got]) == _outputs([want]) == _outputs([base])
        assert got.num_cached_tokens == expected // bs * bs
        assert got.num_cached_tokens >= base.num_cached_tokens
        output = list(got.outputs[0].token_ids)
        cached.append(prompt + output[:-1])
        ours, theirs = ours + got.num_cached_tokens, theirs + base.num_cached_tokens
        return output

    first_output = run(first)
    for prompt in (system + tokens(rng, 50), tokens(rng, 100),
                   first + first_output + tokens(rng, 40),  # the conversation goes on
                   system[:650] + tokens(rng, 30), first):
        run(prompt)
    assert ours > theirs > 0


def test_a_batch_sharing_a_prefix_matches_vllm(kvb, ref, apc):
    """Eight prompts on one system prompt in one batch, twice: requests admitted in the
    step that writes a checkpoint do not resume from it; outputs match."""
    rng = random.Random(9)
    system = tokens(rng, 620)
    prompts = [system + tokens(rng, 30 + 17 * i) for i in range(8)]
    want = _one_by_one(ref, prompts)
    for _ in range(2):
        got, base = generate(kvb, prompts, GREEDY), generate(apc, prompts, GREEDY)
        assert _outputs(got) == want == _outputs(base)
    assert all(g.num_cached_tokens >= b.num_cached_tokens for g, b in zip(got, base))
    assert min(g.num_cached_tokens for g in got) >= 2 * _block_size(kvb)


def test_no_hit_on_a_block_no_step_ended_on(qwen3_next, tmp_path):
    """With a 2048-token budget the scheduler prefills a 1203-token prompt in two chunks,
    ending on 1152 and 1203: only the block ending on 1152 holds a state. A prompt that
    shares 700 tokens covers two whole blocks, yet has no checkpoint to resume from, and
    ``explain_misses`` says so. vLLM's own prefix caching, with the same chunks, is the
    reference."""
    rng = random.Random(13)
    long_prompt = tokens(rng, 1203)
    prompts = [long_prompt, long_prompt[:700] + tokens(rng, 50),
               long_prompt[:1180] + tokens(rng, 30)]
    misses = tmp_path / "misses.jsonl"
    runs = []
    for mode, extra in (("kvbackend", engine_kwargs(explain_misses=str(misses))),
                        ("vllm-apc", {})):
        llm = next(_engine(qwen3_next, mode, max_num_batched_tokens=2048, **extra))
        try:
            runs.append([generate(llm, [p], GREEDY)[0] for p in prompts])
        finally:
            shutdown(llm)
    got, base = runs
    assert _outputs(got) == _outputs(base)
    assert [g.num_cached_tokens for g in got] == [0, 0, 1152]
    assert [b.num_cached_tokens for b in base] == [0, 0, 1152]
    records = [json.loads(line) for line in misses.read_text().splitlines()]
    lost = [[(s["reason"], s["start"], s["end"]) for s in r["lost"]] for r in records]
    assert lost[1][:3] == [("no_state_checkpoint", 0, 2 * STATE_BLOCK),
                           ("block_alignment", 2 * STATE_BLOCK, 700), ("diverged", 700, 749)]
    assert lost[2][0] == ("block_alignment", 1152, 1180)  # resumed from its checkpoint


def test_memory_pressure_keeps_outputs_exact(qwen3_next, kvb, ref):
    """A pool of 20 pages for six 4-block requests (19 distinct blocks, plus the state
    pages of their checkpoints and running steps): checkpointed blocks and their state
    pages are evicted and handed out again while others share them."""
    page = KV_BYTES // kvb.llm_engine.vllm_config.cache_config.num_gpu_blocks
    rng = random.Random(17)
    shared = tokens(rng, 300)
    prompts = [shared + tokens(rng, 700 + 11 * i) for i in range(6)]
    want = _one_by_one(ref, prompts)
    llm = next(_engine(qwen3_next, "kvbackend", max_num_batched_tokens=STATE_BLOCK,
                       max_model_len=1536, kv_cache_memory_bytes=20 * page))
    try:
        for _ in range(2):  # the second round runs on whatever the first left cached
            got = generate(llm, prompts, GREEDY)
            assert _outputs(got) == want
        hits = [g.num_cached_tokens for g in got]
        assert all(h >= STATE_BLOCK for h in hits)  # the shared checkpoint survives
        assert sum(hits) < sum((len(p) - 1) // STATE_BLOCK * STATE_BLOCK
                               for p in prompts)  # but some tails were evicted
    finally:
        shutdown(llm)


def test_under_memory_pressure_hits_and_outputs_match_vllms(qwen3_next):
    """Eight agents, each with its own 1,500-token document after a shared 1,500-token
    system prompt, asked twice in one batch each, prefilled 2,048 tokens per step, in
    8 MiB of KV cache. vLLM keeps a state page only for the block a request runs in and
    for checkpoints; so does kvbackend (it used to keep one for every block, and reused
    49% of the prompt tokens where vLLM reuses 68%). Outputs match vLLM's (equal hits:
    equal chunk ends)."""
    rng = random.Random(5)
    system = tokens(rng, 1500)
    prompts = [system + tokens(rng, 1530) for _ in range(8)]
    hits, outputs = {}, {}
    for mode in ("kvbackend", "vllm-apc"):
        llm = next(_engine(qwen3_next, mode, max_model_len=4096, kv_cache_memory_bytes=8 << 20))
        convos, hits[mode], outputs[mode] = list(prompts), [], []
        try:
            for _ in range(2):
                got = generate(llm, convos, GREEDY)
                hits[mode] += [g.num_cached_tokens for g in got]
                outputs[mode] += _outputs(got)
                convos = [c + o + tokens(random.Random(len(c)), 30)
                          for c, o in zip(convos, _outputs(got))]
        finally:
            shutdown(llm)
    assert outputs["kvbackend"] == outputs["vllm-apc"]
    assert sum(hits["kvbackend"]) >= sum(hits["vllm-apc"]) > 0


def _hybrid_config(mode: str = "align") -> KVCacheConfig:
    state = MambaSpec(block_size=STATE_BLOCK, shapes=((4, 8),), dtypes=(torch.bfloat16,),
                      mamba_cache_mode=mode)
    attention = FullAttentionSpec(block_size=STATE_BLOCK, num_kv_heads=2, head_size=128,
                                  dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.linear_attn"], state),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], attention)])


def test_hybrids_are_served_with_async_scheduling(qwen3_next):
    """The CPU build turns async scheduling off: set here as on a GPU
    (``test_state_checkpoints.py`` drives it on vLLM's real scheduler)."""
    config = EngineArgs(model=qwen3_next, dtype="bfloat16", max_model_len=2048,
                        **engine_kwargs()).create_engine_config()
    config.scheduler_config.async_scheduling = True
    assert unsupported_features(config, _hybrid_config()) == []


@pytest.mark.parametrize("extra, reason", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "prompt_lookup_max": 3}), "together with speculative decoding"),
    (engine_kwargs(example_connector("/nonexistent")),
     "together with a KV connector other than kvbackend's tiers"),
    (engine_kwargs(example_connector("/nonexistent"), host_cache_gb=0.01),
     "together with a KV connector other than kvbackend's tiers"),
    (engine_kwargs({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
     "NIXL moves state too, but on the CPU build vLLM's own prefix caching"),
    (engine_kwargs(host_cache_gb=0.01), None),
])
def test_what_hybrids_are_not_served_with_is_refused(qwen3_next, extra, reason):
    """Speculative decoding and other KV connectors (alone or composed after the tiers)
    are refused with a hybrid; kvbackend's tiers alone are served."""
    config = EngineArgs(model=qwen3_next, dtype="bfloat16", max_model_len=2048,
                        **{**engine_kwargs(), **extra}).create_engine_config()
    refused = unsupported_features(config, _hybrid_config())
    if reason is None:
        assert refused == []
    else:
        assert len(refused) == 1 and reason in refused[0], refused
    assert unsupported_features(config, _hybrid_config("none"))[0] == STATE_LAYERS_REFUSAL
