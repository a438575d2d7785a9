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
whose KV it stores (``PrefixIds``: one int per distinct prefix, exact, no hash),
in a real KV tensor (vLLM's CPU layout). A scheduled request reads every position
before its last scheduled one; each must hold that request's own prefix (except in a
block whose synchronous load for that very request failed, before vLLM learns of it
from the step's output: vLLM must then discard the request's output, which here is
``POISON``, a token ``deliver`` refuses; under async scheduling the request's next step,
scheduled before that output, reads it too), so any hit on
a block that was not (yet) written, was overwritten by another request, or copied
before it was written fails at once. Sampled tokens are a fixed function of
(request, position), so the tokens the scheduler appends later are the ones the
worker already used. With speculative decoding a step's last positions are drafts,
of which the worker accepts a random number (``seed``); a rejected draft's slot gets
``GARBAGE`` and the worker continues from where its KV is valid, as vLLM's model
runner does before the scheduler has seen the rejections.

With ``state_layers`` the model also has a Mamba-style state group in vLLM's "align"
mode, and the worker keeps its state blocks as ``preprocess_mamba`` does: before the
forward pass a request's state moves from the block of its previous step's last token
to the block of this step's last token, which the step then updates. A state block
holds the id of the prefix its state summarizes (forgotten once a step writes KV into
the block: the pool hands a block to either group); a request resuming at position p
must find the state of its own first p tokens there, so a hit on a block no step ended
on, one written in that same step, or a state page handed out again fails at once.

With ``window`` the model also has a sliding-window group: every token's KV is written
in both groups' blocks, and a step's queries from position ``start`` on read the window
group's slots from ``start - window + 1`` on only (its table holds vLLM's null block
before the request's window). ``check_published`` checks the window pages that
published blocks still have.

With a KV connector configured, its worker-role side (kvbackend's tiers: real
``TierWorker``, ``HostTier``, ``DiskTier``; or ``StoreConnector``) moves those bytes in
the model runner's order: loads before the forward pass when the step has synchronous
ones, else after it; saves after it; then finished loads and load errors into the
step's ``KVConnectorOutput``. ``check_published``, after every step and every output,
matches every request's tokens against the prefix tree and checks each published
slot holds that prefix: no block of a failed load is ever published.
``StoreConnector`` stands for a connector that loads outside the step order: no block
it loads into may be one a step still in flight uses (checked as it is scheduled).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvbackend.vllm.namespace import request_namespace
from kvbackend.vllm.scheduler import KVBackendScheduler
from tests.vllm.conftest import block_hasher
from tests.vllm.store_connector import StoreConnector, StoreMetadata

MAX_IN_FLIGHT = 2  # vLLM's max_concurrent_batches with async scheduling (no PP)
VOCAB = 50
POISON = VOCAB  # sampled from KV that failed to load: never a token the model samples
GARBAGE = -1  # the KV of a rejected draft token: no prefix's
STATE_BYTES = -2  # a state page's bytes, which attention may read as NaN
NUM_KV_HEADS, HEAD_SIZE = 1, 8  # the synthetic KV cache: one layer "attn"


def async_config(model: str, *, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, speculative_config: dict | None = None):
    """A device-only kvbackend ``VllmConfig`` with async scheduling forced on (~20 s)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvbackend.vllm import engine_kwargs

    config = EngineArgs(model=model, dtype="float32", max_model_len=1024, enforce_eager=True,
                        speculative_config=speculative_config,
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

    def of(self, tokens) -> list[int]:
        """The id of ``tokens[:p + 1]`` for every position p. O(len(tokens))."""
        ids, parent = [], 0
        for token in tokens:
            parent = self.extend(parent, int(token))
            ids.append(parent)
        return ids


@dataclass
class _WorkerRequest:
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)
    second: list[int] = field(default_factory=list)  # the state or sliding-window group's
    prefix_ids: list[int] = field(default_factory=list)  # id of tokens[:p + 1] at p
    # The first position whose KV the worker has not written validly. The scheduler's count
    # runs ahead of it by the rejected drafts of steps whose output it had not seen yet.
    next_position: int | None = None


class ContentWorker:
    """The model runner, reduced to which token prefix each KV slot holds (0: none).
    ``connector``: the worker-role tier connector, or None."""

    def __init__(self, block_size: int, num_blocks: int, connector=None,
                 state_layers: bool = False, accept=None, max_drafts: int = 0,
                 window: int | None = None) -> None:
        self.block_size, self.window = block_size, window
        # speculative decoding: (request, first draft's position, drafts) -> drafts accepted
        self.accept, self.max_drafts = accept, max_drafts
        self.drafts = self.accepted = 0  # draft tokens run, and kept
        # state block -> id of the prefix whose state it holds; request -> its state block
        self.states: dict[int, int] | None = {} if state_layers else None
        self.state_index: dict[str, int] = {}
        # vLLM's CPU layout [K/V, block, head, offset, dim]; every value of a slot is its id
        self.kv = torch.zeros(2, num_blocks, NUM_KV_HEADS, block_size, HEAD_SIZE)
        self.prefixes = PrefixIds()
        self.requests: dict[str, _WorkerRequest] = {}
        self.prompts: dict[str, list[int]] = {}
        self.connector = connector
        # block -> the request whose load of it failed, until a step writes it again
        self.unloaded: dict[int, str] = {}
        if connector is not None:  # the sliding-window group's layer shares the tensor
            connector.register_kv_caches({"attn": self.kv, **({"swa": self.kv} if window
                                                              else {})})

    def slot(self, block_id: int, offset: int) -> int:
        return int(self.kv[0, block_id, 0, offset, 0])

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

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, tuple[int, int]], set[str],
                                                     KVConnectorOutput | None]:
        """Run one step; returns, per scheduled request, the position of its first draft
        token (its last scheduled position + 1 without drafts) and the first position
        whose KV it did not write validly (past its accepted drafts), the requests that
        read a block whose synchronous load failed in this very step (vLLM discards their
        output: they sample ``POISON``) and the tier connector's output (None when empty,
        as the model runner sends it).

        Speculative decoding: the step's last ``len(scheduled_spec_decode_tokens[r])``
        positions are drafts, of which ``accept`` picks how many the model keeps; a
        rejected draft's slot gets ``GARBAGE``. As vLLM's model runner under async
        scheduling, a running request continues from where its KV is valid, before the
        rejections the scheduler has not seen (or earlier, where the scheduler says so)."""
        cached = out.scheduled_cached_reqs
        for request_id in (out.finished_req_ids | (out.preempted_req_ids or set())
                           | cached.resumed_req_ids):
            self.state_index.pop(request_id, None)
        for request_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self.requests.pop(request_id, None)
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _WorkerRequest(self.prompts[new.req_id],
                                                       *map(list, new.block_ids))
            starts[new.req_id] = new.num_computed_tokens
            self._forget_failed_loads(new.block_ids[0])
        for i, request_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                self.requests[request_id] = _WorkerRequest(self.prompts[request_id],
                                                           *map(list, new_ids))
                self._forget_failed_loads(new_ids[0])
            elif new_ids is not None:
                for table, ids in zip((self.requests[request_id].blocks,
                                       self.requests[request_id].second), new_ids):
                    table.extend(ids)
            scheduled = cached.num_computed_tokens[i]
            valid = self.requests[request_id].next_position
            assert valid is None or scheduled - valid <= self.max_drafts, (
                f"{request_id}: the scheduler continues at {scheduled}, its KV is valid to {valid}")
            # (the scheduler may go back: a failed load is recomputed)
            starts[request_id] = scheduled if valid is None else min(scheduled, valid)
        bs = self.block_size
        if out.new_block_ids_to_zero:  # as vLLM's model runner, before anything else
            self.kv[:, out.new_block_ids_to_zero] = 0
            if self.states is not None:
                for block_id in out.new_block_ids_to_zero:
                    self.states.pop(block_id, None)
        copies = out.kv_cache_block_copies or ()
        if copies:  # all at once, as vLLM's copy_kv_cache_blocks_inplace: every source is
            # read before any destination is written, so a copy never reads another's
            src = [copy.src_block_id for copy in copies]
            dst = [copy.dst_block_id for copy in copies]
            self.kv[:, dst] = self.kv[:, src]
            if self.states is not None:  # a state group's block: its state moves too
                self.states.update(zip(dst, [self.states.get(b, 0) for b in src]))
        if self.states is not None:
            self._advance_states(out, starts)
        connector, failed = self.connector, set()
        if connector is not None:
            connector.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                connector.start_load_kv(None)
                failed = connector.get_block_ids_with_load_errors()
                self._record_failed_loads(failed)
        computed = self._verify_drafts(out, starts)
        written: dict[tuple[int, int], str] = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            tables, valid = self._attention_tables(request_id), computed[request_id][1]
            end = starts[request_id] + num_tokens
            for blocks in tables:
                assert len(blocks) * bs >= end, (
                    f"{request_id}: {len(blocks)} blocks for {end} tokens")
            for p in range(starts[request_id], end):
                for blocks in tables:
                    slot = (blocks[p // bs], p % bs)
                    assert slot[0] != 0 and written.setdefault(slot, request_id) == request_id, (
                        f"step writes slot {slot} for {written[slot]} and {request_id}")
                    if self.states is not None:  # a state page is a pool block too
                        self.states.pop(slot[0], None)
                    self.unloaded.pop(slot[0], None)
                    self.kv[:, slot[0], :, slot[1]] = (self.prefix_id(request_id, p)
                                                       if p < valid else GARBAGE)
        for request_id in out.num_scheduled_tokens:  # attention reads whole blocks, masked
            for blocks in self._attention_tables(request_id):
                stale = [b for b in blocks if b and bool((self.kv[0, b, 0, :, 0]
                                                          == STATE_BYTES).any())]
                assert not stale, (f"{request_id} reads attention blocks {stale} that hold a "
                                   "state page's bytes: new attention blocks must be zeroed")
        poisoned = set()
        for request_id in out.num_scheduled_tokens:
            for blocks, first in zip(self._attention_tables(request_id),
                                     (0, max(0, starts[request_id] - (self.window or 0) + 1))):
                for p in range(first, computed[request_id][1]):
                    if self.unloaded.get(blocks[p // bs]) == request_id:
                        # its own failed load, before vLLM learns of it from the output
                        poisoned.add(request_id)
                        continue
                    held = self.slot(blocks[p // bs], p % bs)
                    assert held == self.prefix_id(request_id, p), (
                        f"{request_id} reads position {p} (block {blocks[p // bs]}), which "
                        f"holds KV of another prefix or none (computed from "
                        f"{starts[request_id]})")
        if connector is None:
            return computed, poisoned, None
        if not out.has_sync_kv_loads:
            connector.start_load_kv(None)
        connector.wait_for_save()
        transfers = connector.get_transfer_results(out.finished_req_ids)
        late = connector.get_block_ids_with_load_errors()
        self._record_failed_loads(late)
        failed |= late
        result = KVConnectorOutput(finished_recving=transfers.finished_recving,
                                   failed_recving=transfers.failed_recving,
                                   invalid_block_ids=failed)
        connector.clear_connector_metadata()
        return computed, poisoned, None if result.is_empty() else result

    def blocks_used(self, out: SchedulerOutput) -> set[int]:
        """The blocks step ``out`` reads or writes (after ``execute(out)``). O(blocks)."""
        used = {block_id for request_id in out.num_scheduled_tokens
                for table in (self.requests[request_id].blocks, self.requests[request_id].second)
                for block_id in table}
        for copy in out.kv_cache_block_copies or ():
            used |= {copy.src_block_id, copy.dst_block_id}
        return used - {0}

    def _forget_failed_loads(self, table: list[int]) -> None:
        """A table handed to a new or resumed request: its blocks were handed out again,
        or are hits (whose slots the reads below check) or loaded again."""
        for block_id in table:
            self.unloaded.pop(block_id, None)

    def _record_failed_loads(self, block_ids: set[int]) -> None:
        """Remember the running request whose table holds each failed block (a request
        waiting for an asynchronous load is not running: it reads nothing before vLLM
        learns of the failure)."""
        for block_id in block_ids:
            owner = next((request_id for request_id, r in self.requests.items()
                          if block_id in r.blocks), None)
            if owner is not None:
                self.unloaded[block_id] = owner

    def _attention_tables(self, request_id: str) -> list[list[int]]:
        """The request's full-attention table, and its sliding-window one with ``window``."""
        request = self.requests[request_id]
        return [request.blocks] + ([request.second] if self.window else [])

    def _verify_drafts(self, out: SchedulerOutput,
                       starts: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Per scheduled request: its first draft's position and the end of what it
        computes validly (``execute``), which is where it continues next step."""
        computed = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            drafts = len(out.scheduled_spec_decode_tokens.get(request_id, ()))
            first_draft = starts[request_id] + num_tokens - drafts
            valid = first_draft + (self.accept(request_id, first_draft, drafts) if drafts else 0)
            computed[request_id] = (first_draft, valid)
            self.drafts, self.accepted = self.drafts + drafts, self.accepted + valid - first_draft
            self.requests[request_id].next_position = valid
        return computed

    def _advance_states(self, out: SchedulerOutput, starts: dict[str, int]) -> None:
        """The state group's step: every request's copy (checked), then every update. The
        copies run in parallel on a GPU (one fused kernel), so none may write a block
        another one reads."""
        bs, copies, updates = self.block_size, {}, []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            table, start = self.requests[request_id].second, starts[request_id]
            previous = self.state_index.get(request_id, (start - 1) // bs)
            current = (start + num_tokens + bs - 1) // bs - 1
            self.state_index[request_id] = current
            assert table[current] != 0, f"{request_id}'s state block {current} is the null block"
            if start:
                held = self.states.get(table[previous], 0)
                assert held == self.prefix_id(request_id, start - 1), (
                    f"{request_id} resumes at {start} from state block {table[previous]}, "
                    "which holds the state of another prefix or none")
                if previous != current:
                    copies[table[previous]] = table[current]
            updates.append((table[current], self.prefix_id(request_id, start + num_tokens - 1)))
        assert not copies.keys() & set(copies.values()), (
            f"a step's state copies write blocks others read: {copies}")
        self.states.update(updates)
        for block_id, _ in updates:  # the page's bytes are a state's now
            self.kv[:, block_id] = STATE_BYTES


def tier_gb(vllm_config, num_blocks: int) -> float:
    """``host_cache_gb`` for a host tier of ``num_blocks`` blocks of the synthetic cache."""
    block_size = vllm_config.cache_config.block_size
    return num_blocks * 2 * NUM_KV_HEADS * block_size * HEAD_SIZE * 4 / (1 << 30)


class AsyncHarness:
    """kvbackend's async scheduler, a ``ContentWorker`` and the outputs in flight.
    ``tiers``: the tier connector's settings (``kv_connector_extra_config``) when
    ``vllm_config`` selects it; any connector it selects gets its worker side."""

    def __init__(self, vllm_config, *, num_blocks: int, tiers: dict | None = None,
                 state_layers: bool = False, window: int | None = None, seed: int = 0) -> None:
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        if tiers is not None:
            vllm_config.kv_transfer_config.kv_connector_extra_config = dict(tiers)
        block_size = vllm_config.cache_config.block_size
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                                 head_size=HEAD_SIZE, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["attn"], spec)]
        if state_layers:  # vLLM's scheduler then ends prefill chunks on block boundaries
            vllm_config.cache_config.mamba_cache_mode = "align"
            groups.append(KVCacheGroupSpec(["state"], MambaSpec(
                block_size=block_size, shapes=((HEAD_SIZE,),), dtypes=(torch.float32,),
                mamba_cache_mode="align")))
        if window:
            groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(
                block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                dtype=torch.float32, sliding_window=window)))
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=groups)
        self.scheduler = KVBackendScheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block_size,
            structured_output_manager=StructuredOutputManager(vllm_config))
        connector = None if vllm_config.kv_transfer_config is None else (
            KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                kv_cache_config))
        rng = random.Random(seed)  # how many of a step's drafts the model accepts
        self.worker = ContentWorker(block_size, num_blocks, connector, state_layers,
                                    accept=lambda request_id, position, drafts: rng.randint(
                                        0, drafts),
                                    max_drafts=vllm_config.num_speculative_tokens,
                                    window=window)
        for child in getattr(connector, "sub_connectors", [connector]):  # a MultiConnector's
            if isinstance(child, StoreConnector):
                child.prefixes = self.worker.prefixes
        self.requests: dict[str, Request] = {}
        # vLLM hashes requests' blocks whenever a KV connector runs
        self.block_hasher = (block_hasher(block_size) if vllm_config.kv_transfer_config
                             else None)
        # steps run, their outputs not delivered yet, with the blocks each used
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput, set[int]]] = []
        self.max_in_flight = MAX_IN_FLIGHT if vllm_config.scheduler_config.async_scheduling else 1

    def add(self, request_id: str, prompt: list[int], max_tokens: int,
            priority: int = 0) -> None:
        request = Request(request_id, list(prompt),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          priority=priority, block_hasher=self.block_hasher)
        self.requests[request_id] = request
        self.worker.prompts[request_id] = list(prompt)
        self.scheduler.add_request(request)

    def schedule(self) -> SchedulerOutput:
        """Schedule and run one step; its output waits in ``in_flight``."""
        assert len(self.in_flight) < self.max_in_flight
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        for child in getattr(meta, "metadata", (meta,)):  # a MultiConnector's, or its own
            if not isinstance(child, StoreMetadata):
                continue
            loaded = {b for load in child.loads for b in load.block_ids}  # out of step order
            for step, _, used in self.in_flight:
                assert not loaded & used, (
                    f"blocks {sorted(loaded & used)} are loaded into while step "
                    f"{step.num_scheduled_tokens} still in flight uses them")
        computed, poisoned, connector_output = self.worker.execute(out)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            first_draft, valid = computed[request_id]
            if self.scheduler.requests[request_id].is_prefill_chunk:
                sampled.append([])
            elif request_id in poisoned:
                sampled.append([POISON])
            else:  # the accepted drafts, then the token after them
                sampled.append([generated_token(request_id, p)
                                for p in range(first_draft, valid + 1)])
        self.in_flight.append((out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, kv_connector_output=connector_output),
            self.worker.blocks_used(out)))
        self.check_published()
        return out

    def deliver(self) -> None:
        """Feed back the oldest step's output, as the engine core does."""
        out, result, _ = self.in_flight.pop(0)
        self.scheduler.update_from_output(out, result)
        self.check_published()
        for request_id in out.num_scheduled_tokens:
            request = self.requests[request_id]
            for p in range(request.num_prompt_tokens, request.num_tokens):
                assert request.all_token_ids[p] == generated_token(request_id, p), (
                    f"{request_id}: position {p} holds a token the model did not sample")

    def run_to_end(self, max_steps: int = 200) -> None:
        """Schedule and deliver, keeping the batch queue full, until no request is left."""
        for _ in range(max_steps):
            unfinished = self.scheduler.has_unfinished_requests()
            if self.in_flight and (len(self.in_flight) == self.max_in_flight or not unfinished):
                self.deliver()
            elif unfinished:
                self.schedule()
            else:
                return
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def host_mirror_is_the_host_tier(self) -> bool:
        """Whether the tier planner's host mirror names exactly what the worker's host
        tier holds, once every step's output is in. O(host blocks)."""
        planner = self.scheduler.connector.planner
        clear, drops = planner.pending_host_changes()
        host = self.worker.connector.worker.mover.host
        held = set() if clear else set(host.keys_lru()) - set(drops)
        return held == set(planner.host.keys())

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def check_published(self) -> None:
        """Every published slot on every request's path holds that path's prefix (every
        step scheduled so far has run). O(requests * tokens)."""
        manager, bs = self.scheduler.kv_cache_manager, self.worker.block_size
        for request_id, request in self.requests.items():
            tokens = list(request.all_token_ids)
            match = manager.cache.match(tokens, request_namespace(request), touch=False)
            ids = self.worker.prefixes.of(tokens[:match.num_tokens])
            for p, prefix_id in enumerate(ids):
                logical = match.block_ids[p // bs]
                groups = [0] + ([1] if self.worker.window and manager.windows.has_pages(logical)
                                else [])
                for group in groups:
                    block_id = manager.groups.physical(logical, group)
                    assert self.worker.slot(block_id, p % bs) == prefix_id, (
                        f"published block {block_id} (group {group}) does not hold "
                        f"{request_id}'s position {p}")
