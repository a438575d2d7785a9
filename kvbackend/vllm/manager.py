"""vLLM's ``KVCacheManager``, backed by kvbackend's token-exact ``PrefixCache``.

The scheduler's calls map onto the core like this:

    get_computed_blocks(req)    match(tokens[:limit])           no side effect
    allocate_slots(new req)     open_sequence(match) + cache()  shares the hit,
                                                                copies a partial block
    allocate_slots(running)     extend() + cache()              append-only block table
    take_kv_cache_block_copies  take_block_copies()             run by the worker
                                                                before the forward pass
    free(req)                   cache(computed) + release()     blocks stay matchable

Tokens are published to the tree when they are scheduled, as vLLM does: a
request admitted in the same step may share those *full* blocks, because every
layer writes the whole batch's KV before it attends. A *partial* hit is served
by copying its block before the forward pass, so it must not come from a block
written in the current step: such a hit falls back to the longest one whose
partial block is older (a node higher on the path, e.g. the conversation two
branches continue, holds its own copy), else to the last full block. Each
fallback is one more match, O(depth + tokens), and only while a match ends in a
block written this step.

Tokens loaded by kvbackend's tier connector (host memory / disk) arrive as
``num_external_computed_tokens``: they get fresh blocks right after the device
hit, which vLLM makes block-aligned whenever an external hit exists (it drops
a partial device tail, so no copy-on-write block is ever overwritten by a
load). They count as computed once loaded, but a load can fail (a missing or
corrupted block), and vLLM learns that only after the step ran. So a request
that loads is *not* published to the tree in its admission step; its next
``allocate_slots`` (or ``free``) publishes what is then known to be computed:
vLLM has by then cut ``num_computed_tokens`` back to the first failed block
(``kv_load_failure_policy="recompute"``), and those tokens are recomputed into
the same blocks. Nothing another request can match ever comes from a failed load.

Async scheduling (``KVBackendAsyncScheduler``): step N+1 is scheduled while
step N runs, so ``num_computed_tokens`` counts tokens whose step has not run
and output placeholders (tokens not sampled yet). kvbackend keeps vLLM's own
rule, and the reason it is safe: the worker runs steps, their block copies and
their KV writes in the order they were scheduled (one device stream), so what
a step reads was written by an earlier step, or by the same step before the
attention that reads it. Hence:

- *publishing*: tokens are published when scheduled, never beyond
  ``request.num_tokens`` (token ids known; a placeholder is never published),
  so a request admitted in step N+1 may hit blocks step N writes: they are
  written before step N+1 runs. ``cache_blocks``, which vLLM's async scheduler
  calls after each output with the tokens computed so far, publishes a block
  whose last token id arrived with that output (its KV was scheduled before).
- *copy-on-write*: a partial hit is copied before its own step's forward pass,
  so only blocks written in *that* step are refused as sources (above); a
  source written by the in-flight step N is complete before step N+1's copies
  run. Sources are released when the next step is scheduled: a block handed
  out again then is written by a later step, after the copy.
- *frees*: a request freed (finished, aborted, preempted) while step N still
  writes its blocks returns them at once, as vLLM does: whoever gets them
  writes in step N+1 or later, after step N's writes. vLLM defers frees
  (``pop_blocks_for_free``) only for a connector that loads into blocks
  outside the step order; kvbackend's tier connector is such a writer, so
  async scheduling with tiers is refused at start and failed tier loads keep
  the handling above. ``tests/vllm/test_async_scheduling.py`` checks every
  read of every step against the token prefix its slot holds.

vLLM's ``KVCacheManager`` surface (``tests/vllm/test_manager_surface.py`` fails
when vLLM adds a public member that this table does not name):

    member                             kvbackend   why
    get_computed_blocks                overridden  token-exact tree match
    allocate_slots                     overridden  open / extend a sequence, publish
    free                               overridden  publish, then release
    cache_blocks                       overridden  publish what is known computed (after a
                                                   failed load; after async outputs)
    get_blocks                         overridden  the sequence's block table
    estimate_cached_tokens             overridden  tokens under the locked node
    usage                              overridden  held blocks of kvbackend's pool
    reset_prefix_cache                 overridden  clears the tree
    take_kv_cache_block_copies         overridden  copy-on-write copies of partial hits
    new_step_starts                    overridden  copies ran; step's writes are done
    evict_blocks                       overridden  checks no failed block is published
    remove_skipped_blocks              overridden  full attention: nothing leaves a window
    pop_blocks_for_free                overridden  deferred frees: refused (only for
                                                   connectors loading out of step order)
    finalize_partial_tail_offloads     overridden  Mamba "align" only: none
    get_computed_blocks_for_connector  inherited   not Mamba: calls get_computed_blocks
    get_block_ids                      inherited   reads get_blocks
    get_block_ids_for_computed_tokens  inherited   clips get_block_ids
    truncate_computed_blocks           inherited   slices a lookup result, one group
    create_kv_cache_blocks             inherited   wraps block lists
    prefix_cache_lookup_enabled        inherited   enable_caching is True, honours
                                                   skip_reading_prefix_cache
    record_prefix_cache_stats          overridden  fills prefix_cache_stats, then
                                                   writes the explain_misses record
    make_prefix_cache_stats            inherited   drains prefix_cache_stats
    get_num_common_prefix_blocks       inherited   deprecated, zeros
    take_new_block_ids                 inherited   zeroing is for Mamba / mixed
                                                   precision only: vLLM's unused
                                                   pool records nothing, []
    record_blocks_for_zeroing          inherited   same: no group records ids
    take_boundary_state_offloads       inherited   Mamba "align" only: {}
    take_events                        overridden  kvbackend's device block events
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.request import Request, RequestStatus

from kvbackend.core import PrefixCache, PrefixMatch, Sequence, TokenBuffer
from kvbackend.core.miss_diagnosis import Admission
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.kv_events import DeviceBlockEvents
from kvbackend.vllm.miss_log import MissLog
from kvbackend.vllm.namespace import request_namespace
from kvbackend.vllm.request_options import (
    DEFAULT_OPTIONS, RequestOptionError, RequestOptions, parse_request_options,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _TrackedRequest:
    """What the manager remembers about one live request."""

    namespace: Any
    tokens: TokenBuffer = field(default_factory=TokenBuffer)
    sequence: Sequence | None = None
    match: PrefixMatch | None = None  # from get_computed_blocks, consumed at admission
    num_published: int = 0  # tokens handed to the tree so far
    priority: int = 0
    pin: bool = False
    retain_s: float = 0.0  # after the request finishes, keep its context ahead this long
    cacheable: bool = True  # False for multimodal / embedding prompts: token ids don't name them


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBackendManager(KVCacheManager):
    """A drop-in ``KVCacheManager`` for single-group (full attention) models."""

    def __init__(self, *args: Any, backend_config: KVBackendConfig,
                 kv_events: DeviceBlockEvents | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_kv_cache_groups != 1:
            raise ValueError(
                f"kvbackend serves models with one KV-cache group (full attention); this model "
                f"has {self.num_kv_cache_groups} (hybrid / sliding-window / Mamba layers)")
        self.enable_caching = True  # vLLM's own hashing stays off; lookups are ours
        self.block_size = kwargs["scheduler_block_size"]
        num_blocks = self.kv_cache_config.num_blocks
        self.cache = PrefixCache(num_blocks, self.block_size,
                                 max_pinned_fraction=backend_config.max_pinned_fraction,
                                 max_retained_fraction=backend_config.max_retained_fraction)
        self._block_objects = [KVCacheBlock(i) for i in range(num_blocks)]
        self._requests: dict[str, _TrackedRequest] = {}
        self._written_this_step: set[int] = set()
        self.kv_events = kv_events  # set with --kv-events-config
        self.miss_log = (MissLog(backend_config.explain_misses, self.cache.tree)
                         if backend_config.explain_misses else None)
        self.tier_hit_sources = None  # the tier connector's get_external_cache_hit_sources
        self.hit_tokens = 0  # device tokens reused at admission, all namespaces (monotone)

    # ------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """Token-exact hit, capped at ``num_tokens - 1`` (and the prompt on first admission)."""
        tracked = self._track(request)
        if not tracked.cacheable or not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1
        if request.num_preemptions <= 0:
            limit = min(limit, request.num_prompt_tokens)
        tokens = tracked.tokens.sync(request.all_token_ids)
        match = self.cache.match(tokens, tracked.namespace, max_tokens=limit)
        while match.num_partial_tokens and match.partial_block_id in self._written_this_step:
            # A node higher on the path may hold its own, older copy of that block.
            fallback = max(match.node.start, match.num_full_blocks * self.block_size)
            match = self.cache.match(tokens, tracked.namespace, max_tokens=fallback)
        tracked.match = match
        return self._as_blocks(match.block_ids[: match.num_full_blocks]), match.num_tokens, 0

    def estimate_cached_tokens(self, request: Request) -> int:
        tracked = self._requests.get(request.request_id)
        return tracked.sequence.num_locked_tokens if tracked and tracked.sequence else 0

    # ----------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """All or nothing; returns only the blocks appended to the request's table."""
        if not (num_new_tokens or num_new_computed_tokens or num_external_computed_tokens):
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        if num_encoder_tokens or delay_cache_blocks:
            raise NotImplementedError("kvbackend does not serve asynchronous KV loads or "
                                      "encoder-decoder models (refused at start-up)")
        tracked = self._track(request)
        if num_external_computed_tokens and (tracked.sequence is not None or num_new_computed_tokens
                                             % self.block_size):
            raise RuntimeError(f"request {request.request_id}: external tokens must start on a "
                               "block boundary of a newly admitted request; this indicates a bug")
        computed = (request.num_computed_tokens + num_new_computed_tokens
                    + num_external_computed_tokens)
        total = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        headroom = self.cache.num_allocatable_blocks - reserved_blocks
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if has_scheduled_reqs and waiting:
            headroom -= self.watermark_blocks
        seq = tracked.sequence
        if seq is None:
            match = self._admission_match(request, tracked, num_new_computed_tokens)
            needed = total if not full_sequence_must_fit else max(
                total, min(request.num_tokens, self.max_model_len))
            if _cdiv(needed, self.block_size) - match.num_full_blocks > headroom:
                return None
            if self.miss_log is not None and request.num_preemptions <= 0:
                self._explain_admission(request, tracked, match, num_external_computed_tokens)
            seq = self.cache.open_sequence(match, total)
            if seq is None:
                return None
            allocated = seq.block_ids[match.num_full_blocks:]
            tracked.sequence, tracked.match = seq, None
            self.cache.tree.record_query(tracked.namespace, request.num_tokens, match.num_tokens)
            self.hit_tokens += match.num_tokens
            new_block_ids = seq.block_ids  # all of them are new to the request's table
        else:
            if _cdiv(total, self.block_size) - len(seq.block_ids) > headroom:
                return None
            new_block_ids = allocated = self.cache.extend(seq, max(total, seq.num_tokens))
            if new_block_ids is None:
                return None
        if self.kv_events is not None:
            self.kv_events.reused(allocated)
        end = computed + num_new_tokens
        first_written = (computed - num_external_computed_tokens) // self.block_size
        self._written_this_step.update(
            seq.block_ids[first_written: _cdiv(end, self.block_size)])
        if not num_external_computed_tokens:  # else: published once the load is known good
            self._publish(request, tracked, min(end, request.num_tokens))
        return self._as_blocks(new_block_ids)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.sequence is not None:
            self._publish(request, tracked, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Publish every computed token (partial tail included), then release; a
        finished request with ``kv_retain_s`` leaves its context retained."""
        if self.miss_log is not None:
            self.miss_log.forget(request.request_id)
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None or tracked.sequence is None:
            return
        self._publish(request, tracked, request.num_computed_tokens, force=True)
        retain_s = tracked.retain_s if tracked.cacheable and request.is_finished() else 0
        self.cache.release(tracked.sequence, retain_s=retain_s)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        raise NotImplementedError("deferred block frees serve KV connectors that load outside "
                                  "the step order under async scheduling or pipeline "
                                  "parallelism, which kvbackend refuses at start-up")

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Blocks whose external load failed (``kv_load_failure_policy="fail"``).

        Nothing to drop: a request that loads is published to the tree only after
        vLLM has cut its computed tokens back to the first failed block, so no
        tree node lists a failed block. Checked here, O(nodes); a violation is a bug.
        """
        bad = set(block_ids)
        for node in self.cache.tree.iter_nodes(all_namespaces=True):
            if bad.intersection(node.block_ids):
                raise RuntimeError(f"block(s) {sorted(bad.intersection(node.block_ids))} failed "
                                   "to load but are published in the prefix tree; this "
                                   "indicates a bug")

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Full attention only: no block ever falls out of a window."""

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """Only Mamba "align" groups have partial-tail offloads; kvbackend has none."""
        return []

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and pin; refused (False) while requests hold blocks."""
        if self.cache.sequences:
            return False
        self.cache.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        if self.miss_log is not None:
            self.miss_log.cleared()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """vLLM's hit counters; then, with ``explain_misses``, the request's record
        (vLLM calls this right after the tier connector planned its loads, so the
        tier of each loaded token is known)."""
        super().record_prefix_cache_stats(request, num_hits)
        if self.miss_log is not None:
            sources = self.tier_hit_sources or (lambda req, n: {})
            self.miss_log.write(request.request_id, lambda n: sources(request, n))

    # ----------------------------------------------------------- read-outs
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.sequence is None:
            return self.empty_kv_cache_blocks
        return self._as_blocks(tracked.sequence.block_ids)

    @property
    def usage(self) -> float:
        pool = self.cache.pool
        return pool.num_held / pool.num_usable_blocks

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Copies for the worker to run before this step's forward pass; their
        source blocks stay held until the next step starts."""
        return [KVCacheBlockCopy(c.src, c.dst) for c in self.cache.take_block_copies()], []

    def take_events(self) -> list[KVCacheEvent]:
        """This step's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` for the
        device blocks (``--kv-events-config``); see ``kv_events.py``."""
        if self.kv_events is None:
            return []
        events = self.kv_events.take()
        kind, window = self.kv_cache_event_metadata[0]
        for event in events:
            if isinstance(event, BlockStored):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = kind, window
        return events

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self.cache.complete_block_copies()  # the previous step, and its copies, have run
        self._written_this_step.clear()

    # -------------------------------------------------------------- helpers
    def _track(self, request: Request) -> _TrackedRequest:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = _TrackedRequest(namespace=request_namespace(request))
            options = _retention(request)
            tracked.priority, tracked.pin = options.priority, options.pin
            tracked.retain_s = options.retain_s
            tracked.cacheable = not request.mm_features and request.prompt_embeds is None
            self._requests[request.request_id] = tracked
        return tracked

    def _admission_match(self, request: Request, tracked: _TrackedRequest, hit: int) -> PrefixMatch:
        """The match ``get_computed_blocks`` returned, re-taken if the tree moved since."""
        match = tracked.match
        if match is None or match.num_tokens != hit or not self.cache.tree.is_current(match):
            tokens = tracked.tokens.sync(request.all_token_ids)
            match = self.cache.match(tokens, tracked.namespace, max_tokens=hit)
            if match.num_tokens != hit:
                raise RuntimeError(f"request {request.request_id}: the scheduler adopted {hit} "
                                   f"cached tokens but only {match.num_tokens} are cached; "
                                   "this indicates a bug")
        return match

    def _explain_admission(self, request: Request, tracked: _TrackedRequest, match: PrefixMatch,
                           num_external_tokens: int) -> None:
        """Diagnose the first admission for ``explain_misses``, before the request's own
        blocks change the tree. O(prompt tokens)."""
        prompt = tracked.tokens.sync(request.all_token_ids)[: request.num_prompt_tokens]
        admission = Admission(min(request.num_tokens - 1, request.num_prompt_tokens),
                              match.num_tokens, num_external_tokens,
                              lookup=self.prefix_cache_lookup_enabled(request),
                              cacheable=tracked.cacheable)
        self.miss_log.admitted(request.request_id, tracked.namespace, prompt, admission,
                               self._written_this_step)

    def _publish(self, request: Request, tracked: _TrackedRequest, num_tokens: int,
                 force: bool = False) -> None:
        """Insert ``tokens[:num_tokens]`` into the tree: during prefill, when a block
        boundary is crossed, or when forced (request end)."""
        done = tracked.num_published
        if num_tokens <= done or not tracked.cacheable:
            return
        in_prefill = done < request.num_prompt_tokens
        if not (force or in_prefill or num_tokens // self.block_size > done // self.block_size):
            return
        tokens = tracked.tokens.sync(request.all_token_ids)[:num_tokens]
        num_new = self.cache.cache(tracked.sequence, tokens, priority=tracked.priority)
        if self.kv_events is not None and num_new:
            self.kv_events.stored(request, tokens, tracked.sequence.block_ids,
                                  (num_tokens - num_new) // self.block_size,
                                  num_tokens // self.block_size)
        tracked.num_published = num_tokens
        if self.miss_log is not None:
            self.miss_log.published(request.request_id, tracked.namespace, tokens)
        if tracked.pin and done < request.num_prompt_tokens <= num_tokens:
            if not self.cache.pin(tokens[: request.num_prompt_tokens], tracked.namespace):
                logger.warning("kvbackend: request %s asked for kv_pin, but pinning its %d-token "
                               "prompt would exceed max_pinned_fraction", request.request_id,
                               request.num_prompt_tokens)

    def _as_blocks(self, block_ids) -> KVCacheBlocks:
        if not block_ids:
            return self.empty_kv_cache_blocks
        objects = self._block_objects
        return KVCacheBlocks(([objects[b] for b in block_ids],))


def _retention(request: Request) -> RequestOptions:
    """The request's ``kv_priority`` / ``kv_pin`` / ``kv_retain_s``; the defaults, with a
    warning, when bad (the API process rejects bad values; this only sees requests that
    bypassed it)."""
    params = request.sampling_params
    try:
        return parse_request_options(params.extra_args if params is not None else None)
    except RequestOptionError as e:
        logger.warning("kvbackend: request %s: %s; using the defaults", request.request_id, e)
        return DEFAULT_OPTIONS
