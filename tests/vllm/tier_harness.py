"""vLLM's real scheduler with kvbackend's tier connector, stepped by hand in this process.

``TierHarness`` builds ``KVBackendScheduler`` (which creates the scheduler-role
connector through vLLM's connector factory) and one worker-role connector from
the same factory, registered on CPU KV tensors in vLLM's CPU layout. A step is
vLLM's own sequence: ``schedule()``, the worker connector's hooks in the model
runner's order (bind, ``start_load_kv``, ``wait_for_save``, load errors, clear),
then ``update_from_output`` with one sampled token per request that finished its
prompt. No forward pass runs, so KV contents are not checked here (the engine
tests and the planner's stateful test do that); what runs is every scheduling
decision and every byte the connector moves between the KV tensors and the tiers.
"""

from __future__ import annotations

import glob
import os

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvbackend.store.disk_tier import FORMAT_DIR
from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.scheduler import KVBackendScheduler
from tests.vllm.conftest import BLOCK_SIZE

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 2, 2, 32  # the tiny Llama of tests/vllm/conftest.py
BLOCK_NBYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE * 4  # float32
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def base_config(model: str):
    """A ``VllmConfig`` for the tiny model with the tier connector selected (~20 s)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=1024,
                      enforce_eager=True, kv_cache_memory_bytes=32 << 20,
                      **engine_kwargs(host_cache_gb=1))
    return args.create_engine_config()


def host_gb(num_blocks: int) -> float:
    """``host_cache_gb`` for a host tier of exactly ``num_blocks`` blocks."""
    return num_blocks * BLOCK_NBYTES / (1 << 30)


class TierHarness:
    """A scheduler and one worker of a TP=1 engine, without the model."""

    def __init__(self, vllm_config, *, num_blocks: int, host_blocks: int = 0,
                 disk_dir: str | None = None, log_stats: bool = False) -> None:
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        vllm_config.kv_transfer_config.kv_connector_extra_config = dict(
            host_cache_gb=host_gb(host_blocks), disk_cache_dir=disk_dir, disk_cache_gb=1.0)
        self.disk_dir = disk_dir
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                 head_size=HEAD_SIZE, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
        self.scheduler = KVBackendScheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=BLOCK_SIZE,
            structured_output_manager=StructuredOutputManager(vllm_config), log_stats=log_stats)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                          kv_cache_config)
        shape = (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        self.kv_caches = {name: torch.zeros(shape) for name in LAYER_NAMES}
        self.worker.register_kv_caches(self.kv_caches)
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                                   ignore_eos=True), None)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, output: SchedulerOutput, other_rank_failures: set[int] = frozenset()):
        """Run the worker connector's hooks for ``output`` and feed the result back.
        ``other_rank_failures``: block ids another TP rank failed to load (vLLM
        reports the union of every rank's failures)."""
        worker = self.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        failed = worker.get_block_ids_with_load_errors() | set(other_rank_failures)
        worker.clear_connector_metadata()
        ids = list(output.num_scheduled_tokens)
        sampled = [[7] if self.requests[r].num_computed_tokens >= self.requests[r].num_tokens
                   else [] for r in ids]
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(invalid_block_ids=failed))
        self.scheduler.update_from_output(output, result)
        return failed

    def step(self, other_rank_failures: set[int] = frozenset()) -> SchedulerOutput:
        output = self.schedule()
        self.execute(output, other_rank_failures)
        return output

    def run(self, max_steps: int = 100) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def block_ids(self, request_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return list(ids)

    def disk_paths(self) -> list[str]:
        return glob.glob(os.path.join(str(self.disk_dir), FORMAT_DIR, "*", "*", "*.kvb"))

    def disk_files(self) -> set[str]:
        return {os.path.basename(p) for p in self.disk_paths()}
