"""kvbackend's scheduler under async scheduling, driven without a model.

vLLM's CPU platform turns async scheduling off, so ``AsyncHarness`` builds the
scheduler itself (``async_scheduling=True`` on a real ``VllmConfig``) and plays
the engine core's batch queue: ``schedule()`` may run again before the previous
step's output is fed back (at most ``MAX_IN_FLIGHT`` steps outstanding, as
``max_concurrent_batches`` allows), and outputs come back in step order. With
async scheduling off the same harness runs one step at a time.

``ContentWorker`` stands in for the model runner. It executes every
``SchedulerOutput`` in the order the scheduler produced it, as the GPU stream
does: block tables from the output (full lists for new and resumed requests,
appended ids otherwise), then the step's block copies, then every scheduled
token's KV write, then every read. A KV slot holds the id of the token prefix
whose KV it stores (``PrefixIds``: one int per distinct prefix, exact, no hash).
A scheduled request reads every position before its last scheduled one; each
must hold that request's own prefix, so any hit on a block that was not (yet)
written, was overwritten by another request, or copied before it was written
fails at once. Sampled tokens are a fixed function of (request, position), so
the tokens the scheduler appends later are the ones the worker already used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvbackend.vllm.scheduler import KVBackendScheduler

MAX_IN_FLIGHT = 2  # vLLM's max_concurrent_batches with async scheduling (no PP)
VOCAB = 50


def async_config(model: str, *, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int):
    """A device-only kvbackend ``VllmConfig`` with async scheduling forced on (~20 s)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvbackend.vllm import engine_kwargs

    config = EngineArgs(model=model, dtype="float32", max_model_len=1024, enforce_eager=True,
                        **engine_kwargs()).create_engine_config()
    sched = config.scheduler_config
    sched.async_scheduling = True  # what vLLM picks on a GPU; the CPU platform turned it off
    sched.max_num_batched_tokens = sched.max_num_scheduled_tokens = max_num_batched_tokens
    sched.long_prefill_token_threshold = 0
    sched.max_num_seqs = max_num_seqs
    config.cache_config.block_size = block_size
    return config


def generated_token(request_id: str, position: int) -> int:
    """The token the synthetic model samples for ``request_id`` at ``position``."""
    return (sum(map(ord, request_id)) * 31 + position * 7) % VOCAB


class PrefixIds:
    """Interns token prefixes: equal prefixes get equal ids. O(1) per extension."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def extend(self, parent: int, token: int) -> int:
        return self._ids.setdefault((parent, token), len(self._ids) + 1)


@dataclass
class _WorkerRequest:
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)
    prefix_ids: list[int] = field(default_factory=list)  # id of tokens[:p + 1] at p


class ContentWorker:
    """The model runner, reduced to which token prefix each KV slot holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> prefix id
        self.prefixes = PrefixIds()
        self.requests: dict[str, _WorkerRequest] = {}
        self.prompts: dict[str, list[int]] = {}

    def token(self, request_id: str, position: int) -> int:
        prompt = self.prompts[request_id]
        return prompt[position] if position < len(prompt) else generated_token(request_id,
                                                                               position)

    def prefix_id(self, request_id: str, position: int) -> int:
        ids = self.requests[request_id].prefix_ids
        while len(ids) <= position:
            parent = ids[-1] if ids else 0
            ids.append(self.prefixes.extend(parent, self.token(request_id, len(ids))))
        return ids[position]

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns the first position each scheduled request computed."""
        for request_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self.requests.pop(request_id, None)
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _WorkerRequest(self.prompts[new.req_id],
                                                       list(new.block_ids[0]))
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                self.requests[request_id] = _WorkerRequest(self.prompts[request_id],
                                                           list(new_ids[0]))
            elif new_ids is not None:
                self.requests[request_id].blocks.extend(new_ids[0])
            starts[request_id] = cached.num_computed_tokens[i]
        bs = self.block_size
        for copy in out.kv_cache_block_copies or ():
            for offset in range(bs):
                held = self.slots.get((copy.src_block_id, offset))
                self.slots[(copy.dst_block_id, offset)] = held
        written: dict[tuple[int, int], str] = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            blocks = self.requests[request_id].blocks
            end = starts[request_id] + num_tokens
            assert len(blocks) * bs >= end, f"{request_id}: {len(blocks)} blocks for {end} tokens"
            for p in range(starts[request_id], end):
                slot = (blocks[p // bs], p % bs)
                assert written.setdefault(slot, request_id) == request_id, (
                    f"step writes slot {slot} for {written[slot]} and {request_id}")
                self.slots[slot] = self.prefix_id(request_id, p)
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            blocks = self.requests[request_id].blocks
            for p in range(starts[request_id] + num_tokens):
                held = self.slots.get((blocks[p // bs], p % bs))
                assert held == self.prefix_id(request_id, p), (
                    f"{request_id} reads position {p} (block {blocks[p // bs]}), which holds "
                    f"KV of another prefix or none (computed from {starts[request_id]})")
        return starts


class AsyncHarness:
    """kvbackend's async scheduler, a ``ContentWorker`` and the outputs in flight."""

    def __init__(self, vllm_config, *, num_blocks: int) -> None:
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        block_size = vllm_config.cache_config.block_size
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                 dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
        self.scheduler = KVBackendScheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block_size,
            structured_output_manager=StructuredOutputManager(vllm_config))
        self.worker = ContentWorker(block_size)
        self.requests: dict[str, Request] = {}
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        self.max_in_flight = MAX_IN_FLIGHT if vllm_config.scheduler_config.async_scheduling else 1

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        request = Request(request_id, list(prompt),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)
        self.requests[request_id] = request
        self.worker.prompts[request_id] = list(prompt)
        self.scheduler.add_request(request)

    def schedule(self) -> SchedulerOutput:
        """Schedule and run one step; its output waits in ``in_flight``."""
        assert len(self.in_flight) < self.max_in_flight
        out = self.scheduler.schedule()
        starts = self.worker.execute(out)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            end = starts[request_id] + out.num_scheduled_tokens[request_id]
            sampled.append([] if request.is_prefill_chunk
                           else [generated_token(request_id, end)])
        self.in_flight.append((out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled)))
        return out

    def deliver(self) -> None:
        """Feed back the oldest step's output, as the engine core does."""
        out, result = self.in_flight.pop(0)
        self.scheduler.update_from_output(out, result)
        for request_id in out.num_scheduled_tokens:
            request = self.requests[request_id]
            for p in range(request.num_prompt_tokens, request.num_tokens):
                assert request.all_token_ids[p] == generated_token(request_id, p), (
                    f"{request_id}: position {p} holds a token the model did not sample")

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
