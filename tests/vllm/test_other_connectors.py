"""kvbackend with another KV connector: its tiers and vLLM's ExampleConnector (disk files
named by the prompt) composed through vLLM's ``MultiConnector`` on the real CPU engine,
and the connectors it refuses, with their reasons.

One engine serves a prompt from each place in turn: computed (both connectors save), the
device (kvbackend's token-exact hit), the host tier (the device reset), the example
connector's files (device and host reset), then a longer prompt whose hit comes from the
tokens the example connector loaded (published once loaded). Greedy outputs always equal
vLLM's without any cache.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.connectors import compose, connector_refusals
from kvbackend.vllm.scheduler import KVBackendScheduler, unsupported_features
from tests.vllm.conftest import (
    BLOCK_SIZE, block_hasher, cached_by_source, cached_since, greedy_outputs, make_engine,
    shutdown,
)
from tests.vllm.store_connector import SchedulerSideConnector
from tests.vllm.tier_harness import host_gb

GREEDY = SamplingParams(temperature=0, max_tokens=6)
_rng = random.Random(3)
PROMPT = [_rng.randrange(3, 500) for _ in range(3 * BLOCK_SIZE + 5)]
LONGER = PROMPT + [_rng.randrange(3, 500) for _ in range(40)]


def example_connector(path: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path}}


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("example-connector"))


@pytest.fixture(scope="module")
def llm(tiny_model, storage):
    engine = make_engine(tiny_model, "kvbackend", disable_log_stats=False,
                         **engine_kwargs(example_connector(storage), host_cache_gb=host_gb(8)))
    yield engine
    shutdown(engine)


@pytest.fixture(scope="module")
def reference(reference_llm):
    return greedy_outputs(reference_llm, (PROMPT, LONGER), GREEDY)


def run(llm, prompt, reference) -> tuple[int, dict[str, float]]:
    """Cached tokens of ``prompt`` and, per source, the tokens loaded by a connector."""
    before = cached_by_source(llm)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference[tuple(prompt)]
    loaded = cached_since(llm, before)
    loaded.pop("device", None)  # hits on the device, not loads
    return out.num_cached_tokens, loaded


def test_tiers_and_example_connector_each_serve_their_hits(llm, reference, storage):
    aligned = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # what either connector loads
    assert run(llm, PROMPT, reference) == (0, {})
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(storage) for f in names)
    assert files and all(f.endswith(".safetensors") for f in files)  # one per layer
    assert run(llm, PROMPT, reference) == (len(PROMPT) - 1, {})  # device: token-exact
    assert llm.reset_prefix_cache()  # the device forgets; host and files remain
    assert run(llm, PROMPT, reference) == (aligned, {"host": aligned})
    assert llm.reset_prefix_cache(reset_connector=True)  # host forgets too; files remain
    assert run(llm, PROMPT, reference) == (aligned, {"external_unspecified": aligned})
    assert run(llm, LONGER, reference) == (len(PROMPT), {})  # device: the loaded tokens


@pytest.fixture(scope="module")
def config(tiny_model):
    return EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                      block_size=BLOCK_SIZE, **engine_kwargs()).create_engine_config()


def with_connector(config, **transfer):
    config = copy.copy(config)
    config.kv_transfer_config = KVTransferConfig(**transfer)
    config.scheduler_config = copy.copy(config.scheduler_config)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # as vLLM sets it
    return config


def test_connectors_that_read_vllms_pool_or_are_unchecked_are_refused(config, tmp_path):
    example = example_connector(str(tmp_path))
    tiers = engine_kwargs(host_cache_gb=1)["kv_transfer_config"]
    assert unsupported_features(with_connector(config, **example)) == []
    assert unsupported_features(with_connector(config, **compose(tiers, example))) == []
    for mode in ("NixlConnector", "NixlPushConnector"):  # test_nixl.py, test_nixl_tiers.py
        nixl = {"kv_connector": mode, "kv_role": "kv_both"}
        assert unsupported_features(with_connector(config, **nixl)) == []
        assert unsupported_features(with_connector(config, **compose(tiers, nixl))) == []
    offloading = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    reason = ("KV connector OffloadingConnector: it reads vLLM's KV-cache coordinator and "
              "block hashes, which kvbackend leaves unused (kvbackend's host, disk and remote "
              "tiers do its job)")
    assert unsupported_features(with_connector(config, **offloading)) == [reason]
    assert unsupported_features(with_connector(config, **compose(tiers, offloading))) == [reason]
    mooncake = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}
    assert connector_refusals(KVTransferConfig(**mooncake)) == [
        "KV connector MooncakeConnector: it would run as NIXL does, but no test of kvbackend "
        "runs Mooncake's transfer engine (its wheel links the CUDA driver and libibverbs: no "
        "load without a GPU) (not checked; NixlConnector, NixlPullConnector and "
        "NixlPushConnector are served)"]
    simple = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}
    assert connector_refusals(KVTransferConfig(**simple)) == [
        "KV connector SimpleCPUOffloadConnector: it reads vLLM's block pool or KV-cache manager "
        "internals (bind_gpu_block_pool), which kvbackend leaves unused"]


def test_compose_puts_pd_then_the_tier_connector_first_and_flattens_a_multi_connector(
        tmp_path):
    tiers = engine_kwargs(host_cache_gb=1)["kv_transfer_config"]
    example = example_connector(str(tmp_path))
    composed = engine_kwargs(KVTransferConfig(**example), host_cache_gb=1)["kv_transfer_config"]
    assert composed == compose(tiers, example)
    children = composed["kv_connector_extra_config"]["connectors"]
    assert children == [tiers, example]
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [example]}}
    assert compose(tiers, multi) == composed
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    multi["kv_connector_extra_config"]["connectors"] = [example, nixl]  # P/D before the tiers
    assert compose(tiers, multi)["kv_connector_extra_config"]["connectors"] == [
        nixl, tiers, example]
    assert engine_kwargs(example)["kv_transfer_config"] == example  # no tier: alone
    assert KVTransferConfig(**composed).kv_load_failure_policy == "recompute"


def test_multi_connector_rebuilds_the_tier_connectors_stats():
    """vLLM's stats logger (API process) rebuilds each child's stats by registered name;
    the tier connector, selected by module path, is registered by the plugin."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvbackend.vllm import TIER_CONNECTOR
    from kvbackend.vllm.plugin import register
    from kvbackend.vllm.tiers.metrics import KVBackendStats

    register()
    sent = KVBackendStats()
    sent.count("hit_tokens", "host", 64)
    rebuilt = MultiConnector.build_kv_connector_stats({TIER_CONNECTOR: sent.data})
    assert rebuilt[TIER_CONNECTOR].reduce() == sent.reduce()


def hashed_request(request_id: str, prompt: list[int]) -> Request:
    """A request with vLLM's block hashes, as an engine with a KV connector makes them."""
    return Request(request_id, prompt, GREEDY, None, block_hasher=block_hasher())


class AsyncLoadConnector(SchedulerSideConnector):
    """A connector holding the full prompt blocks of requests named "load...", loaded
    asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` until the test
    reports the load finished (``finished_recving``), as a worker would."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        held = (request.num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        if not request.request_id.startswith("load") or held <= num_computed_tokens:
            return 0, False
        return held - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


def async_load_scheduler(config, **transfer) -> KVBackendScheduler:
    """kvbackend's scheduler over 16 blocks of one attention layer, with
    ``AsyncLoadConnector``."""
    config = with_connector(config, kv_connector="AsyncLoadConnector", kv_role="kv_both",
                            kv_connector_module_path=__name__, **transfer)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = KVBackendScheduler(config, kv_cache_config, StructuredOutputManager(config),
                                   block_size=BLOCK_SIZE)
    return scheduler


def test_an_asynchronous_load_is_published_once_it_loaded(config):
    """Before: ``allocate_slots(delay_cache_blocks=True)`` raised into the step loop."""
    scheduler = async_load_scheduler(config, kv_load_failure_policy="recompute")
    prompts = {"load-ok": PROMPT, "load-failed": PROMPT[::-1]}  # 3 full blocks held each
    for request_id, prompt in prompts.items():
        scheduler.add_request(hashed_request(request_id, prompt))

    def cached(prompt) -> int:
        probe = hashed_request("probe", prompt)
        hit = scheduler.kv_cache_manager.get_computed_blocks(probe)[1]
        scheduler.kv_cache_manager.free(probe)
        return hit

    def step(**connector_output) -> SchedulerOutput:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[] for _ in ids],
            kv_connector_output=KVConnectorOutput(**connector_output)))
        return out

    assert not step().num_scheduled_tokens  # both wait for their loads
    assert [cached(p) for p in prompts.values()] == [0, 0]  # nothing published meanwhile
    (failed,) = scheduler.kv_cache_manager.get_block_ids("load-failed")
    step(finished_recving=set(prompts), invalid_block_ids={failed[1]})  # its 2nd block failed
    out = step()  # published what loaded, then scheduled the rest (published when scheduled)
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {
        "load-ok": 3 * BLOCK_SIZE, "load-failed": BLOCK_SIZE}
    # Full blocks; the partial tail block is being written this step: no copy from it.
    assert [cached(p) for p in prompts.values()] == [3 * BLOCK_SIZE] * 2
    scheduler.kv_cache_manager.cache.check_invariants()


def test_a_connectors_table_hashes_exactly_the_blocks_taken_from_the_cache(config):
    """NIXL pulls into the blocks of a request's table that carry no vLLM block hash
    (``get_unhashed_block_ids_all_groups``): the blocks past the local hit. Before, every
    block of kvbackend's tables was unhashed (NIXL was refused for it)."""
    scheduler = async_load_scheduler(config)
    manager = scheduler.kv_cache_manager

    def admit(request_id: str, prompt: list[int]) -> Request:
        request = hashed_request(request_id, prompt)
        scheduler.add_request(request)
        scheduler.schedule()  # allocates its table (a load waits for it outside the step)
        return request

    def hashes(request_id: str) -> list:
        return [block.block_hash for block in manager.get_blocks(request_id).blocks[0]]

    computed = admit("computed", PROMPT[: 2 * BLOCK_SIZE + 5])
    # its step is scheduled: its whole blocks are published, as vLLM hashes them then
    assert hashes("computed") == [make_block_hash_with_group_id(h, 0)
                                  for h in computed.block_hashes] + [None]
    admit("load", PROMPT)  # hits the two blocks, loads the third
    table = manager.get_blocks("load")
    assert hashes("load") == hashes("computed")[:2] + [None]
    assert table.get_unhashed_block_ids_all_groups() == [table.get_block_ids()[0][2:]]
