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
layer writes the whole batch's KV before it attends. A step's publishes take
effect once the step can no longer lose a request: vLLM's priority policy may
preempt a request it already scheduled in the same step (in its running loop,
when a later request cannot grow), and that request's scheduled tokens are then
never computed. So ``allocate_slots`` records what it schedules, and the step's
first lookup (``get_computed_blocks``: vLLM looks up only in its waiting loop,
after the running loop, and admits nobody in a step that preempted) or its end
(``take_kv_cache_block_copies``) publishes it; a request freed before then
publishes only its computed tokens. A *partial* hit is served
by copying its block before the forward pass, so the slots it reads must not be
written in the current step (``step_writes.py``; a writer appending past them, as a
conversation still decoding into its last block, is fine): such a hit falls back
to the longest one whose partial block is older (a node higher on the path, e.g.
the conversation two branches continue, holds its own copy), else to the last
full block. Each fallback is one more match, O(depth + tokens), and only while a
match ends on slots this step writes. Once a continuation's copy of a prefix's
partial block ran, the prefix takes that copy and frees its own
(``new_step_starts``: ``PrefixCache.drop_redundant_copies``).

Tokens loaded by a KV connector (kvbackend's host/disk/remote tiers, or another
connector: ``kvbackend.vllm.connectors``) arrive as
``num_external_computed_tokens``: they get fresh blocks right after the device
hit, which vLLM makes block-aligned whenever an external hit exists (it drops
a partial device tail, so no copy-on-write block is ever overwritten by a
load). They count as computed once loaded, but a load can fail (a missing or
corrupted block), and vLLM learns that only after the step ran. So a request
that loads is *not* published to the tree in its admission step. A synchronous
load is published once its step's output is in (``load_step``; the scheduler
counts steps, ``StepFence``): by the request's next ``allocate_slots`` or
``cache_blocks`` after that output, or ``free``. vLLM has by then cut
``num_computed_tokens`` back to the first failed block
(``kv_load_failure_policy="recompute"``), and those tokens are recomputed into
the same blocks. (Under async scheduling the request's next step is scheduled
before that output: nothing is published then.) An asynchronous load
(``delay_cache_blocks``: a remote hit, any tier hit under async scheduling, or
another connector's load; the request waits in WAITING_FOR_REMOTE_KVS) is
published by ``cache_blocks``, which vLLM calls with
the tokens known good once the workers report it done (or ``free`` if none are);
a ``free`` before that (aborted while loading: vLLM then frees it without cutting
its tokens back) publishes nothing (``loading``). Nothing another request can
match ever comes from a failed load.

Speculative decoding (n-gram, suffix, Medusa, MLP speculators, draft models, EAGLE,
EAGLE-3, single-module MTP, DFlash):
``num_new_tokens`` counts the draft tokens and ``num_lookahead_tokens`` the
drafter's extra slots; both get blocks (``computed + new + lookahead``, capped at
``max_model_len``, as vLLM does), but only ``request.all_token_ids`` is ever
published, so a draft is published only once accepted, and then it is a real
token whose KV its verification step wrote. A rejected draft's KV stays in a slot
past ``num_computed_tokens``, which the tree never lists and the next step
overwrites (``tests/vllm/test_spec_decode.py`` checks the tree after every step).
An EAGLE / EAGLE-3 / MTP drafter writes its own KV into the same blocks, and its KV at
a position also reads the next token (``num_prefill_lookahead`` of them: its input
there is that token with the target's hidden state), which is its writer's, not
necessarily the request's. So a hit ends that many tokens before the tree's match of
the request's tokens (``_match_clear_of_drafts``): every hit position's next token is
then one the tree holds, written by the same writer (a block holds one sequence's
tokens), and a partial hit recomputes the rest. vLLM drops a hit's last whole block
instead; kvbackend's tiers do as vLLM (``TierPlanner``: no key vouches for a tier
block's next token). Only the drafter's proposals depend on its KV: a stale one
lowers acceptance, never changes outputs. A DFlash drafter's context KV at a position
reads the target's hidden states there only (its draft queries' KV lands past the
computed tokens), yet vLLM gives it the same lookahead of one. One imprecision
remains, as in vLLM: where two sequences share a whole block and continue differently,
the tree keeps the first one's block, whose last slot's drafter KV read the first one's
next token; a later hit through it into the second one's continuation reads that slot.

Several KV-cache groups (interleaved sliding-window and full attention, e.g.
Gemma 2/3): every group's blocks are cached along the same token boundaries. A
hit is valid where every group has what vLLM's ``HybridKVCacheCoordinator``
requires: full-attention groups the whole prefix, sliding-window groups the last
window. Two layouts (``block_groups.py``; the first one also serves the hybrids
below):

- one full-attention group and sliding-window groups, with no KV connector but
  kvbackend's tiers (``PagedBlockGroups``): a logical block of the tree is the
  full-attention group's block, and its pages in the sliding-window groups are further blocks
  of the same pool (``WindowPages``), held while a live request's window reaches
  the block. As vLLM's ``remove_skipped_blocks`` frees a request's blocks that
  fell out of its windows (on the processed-token basis: in-flight steps still
  read below the optimistic count), ``_advance_window`` stops holding their
  pages; they stay cached (idle) until the pool needs them, and the pool takes
  idle pages and the tree's blocks back in one least-recently-used order. The
  request's table lists vLLM's null block in those groups before its window. A
  hit is cut back to the longest prefix whose last window's blocks all have
  their pages (``WindowPages.longest_hit``, O(blocks of the match)); the hit's
  window blocks, and a partial hit's source until its copy ran, are held before
  any block is handed out, so none of them is reclaimed under it. A request that
  recomputes tokens whose cached block lost its pages gives the tree its own
  block (``_adopt_window_pages``), so hits there come back. Copy-on-write
  copies every group's page. A request thus holds its full-attention blocks and
  a window's worth of pages per sliding-window group, as under vLLM's manager;
  start-up refuses a ``max_model_len`` that cannot fit that (vLLM's admission
  cap per sliding-window group). A tier block holds every group's KV: it is
  saved in the step that computes it, while the window holds its pages (a block
  whose pages a request's window left is not saved), and a tier hit's blocks get
  pages only from the window of its end on: the load fills their pages, and the
  full-attention block of the others, which stay without pages (so a later hit
  ending among them is cut back, as above).
- otherwise (several full-attention groups, another KV connector, which reads
  whole block tables, or groups of different block sizes): one logical block is
  the scheduler's block (the least common multiple of the groups' block sizes),
  and as many physical blocks per group as it spans there (Gemma 4: one
  sliding-window block of 64 tokens and two full-attention blocks of 32, which a
  tier block holds together; other connectors and KV events, which move or
  announce one block per group, are refused with different sizes, and
  ``max_model_len`` must be a multiple of the logical block, the width vLLM gives
  each group's table),
  every group keeping every block of a live or cached sequence, so token-exact
  hits and copy-on-write (one copy per group) carry over unchanged; a
  sliding-window request then holds as many blocks as a full-attention one, and
  start-up refuses a ``max_model_len`` whose blocks (all groups) do not fit the
  pool. kvbackend's tiers keep vLLM's several groups in both layouts (the tier
  connector is ``SupportsHMA``): a tier block is one logical block, loaded into
  fresh blocks of every group; with several groups every tier hit loads asynchronously
  (``delay_cache_blocks``, published by ``cache_blocks`` once done), since vLLM
  reports a failed load then per request, which it recomputes whole (``free``:
  nothing of it was published).

Mamba / linear-attention hybrids (Gated DeltaNet, Mamba): vLLM runs their state
groups in ``mamba_cache_mode="align"`` (the plugin keeps vLLM's prefix-caching
switch on for them, its hashing unused), whose workers keep a request's running
state in the state block of the step's last token. A state block holds the state
after exactly its last token only if a step ended there
(``state_checkpoints.py``), so a hit ends on the longest such block of its
match: whole blocks only (no partial hit, hence no copy-on-write), re-checked at
admission. A hit on a checkpoint the current step writes is not admitted in that
step (``allocate_slots`` returns None, as vLLM's ``MambaManager`` does): the
workers copy a hit's state before the forward pass, so the request resumes from
it one step later. Where the match's whole blocks reach past its checkpoint,
their end is returned as the shared-prefix junction, as vLLM does: its
scheduler ends a chunk there, and the state written there is copied next step
into the block the tree lists for those tokens (a sibling's), so the next
request sharing the prefix resumes from it. With one full-attention group and no KV
connector but kvbackend's tiers (``PagedBlockGroups``, as for sliding windows) a
block has state pages only where a reader needs them (``state_pages.py``), as
vLLM's ``MambaManager`` keeps them: the block a request's previous step ended in
(the workers' copy source) and the one its current step ends in, and, idle until
the pool needs them, the blocks holding a checkpoint; a request's table lists the
null block elsewhere in the state groups. A request thus holds its full-attention
blocks and at most three blocks' state pages (at admission: its hit's, its tier
load's and its step's), and the pool's least-recently-used order takes idle
checkpoints and the tree's blocks back alike; a checkpoint whose pages go back is
forgotten. The junction copy gives the tree's block idle state pages if it has
none (skipped when the pool has no room). Otherwise every group keeps its blocks,
as above: the state blocks of a long request stay, each holding a checkpoint or an
intermediate state no hit reads. kvbackend's tiers serve them: a tier hit ends on
a block saved as a state checkpoint (``TierPlanner``), whose state pages its load
fills; once the load is known good (``cache_blocks``) that block is recorded as a
checkpoint, as if a step had ended there, and the workers resume the request from
it. Other connectors and speculative decoding are refused with such models
(``scheduler.py``); async scheduling is served (below).

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
  writes its blocks returns them at once: whoever computes into them writes in
  step N+1 or later, after step N's writes. A KV connector that loads may fill
  its blocks outside the step order (its own stream), so vLLM defers every free
  for one (``pop_blocks_for_free``). kvbackend keeps only the loads apart
  (``step_fence.py``): an admission whose load would fill a block a step in
  flight still uses (a freed request's table, a copy's source) waits a step.
  Deferring every free, as vLLM does, starved a request needing most of the
  pool: its partial hit's copy source came back a step too late for its next
  block. kvbackend's own tier connector loads in step order: not fenced.
- *tier loads* (kvbackend's host/disk/remote tiers): a load fails (a rotted or
  evicted disk file) and vLLM learns it with the step's output, after step N+1
  was scheduled. A synchronous load would let step N+1 compute on it (vLLM 0.32
  then appends that step's token and keeps its placeholder: a wrong output), so
  under async scheduling every tier hit loads asynchronously: the request waits
  in WAITING_FOR_REMOTE_KVS while its load step runs, and is published by
  ``cache_blocks`` and scheduled only once that step's output, failed blocks
  included, is in (one step later than a synchronous load). ``TierPlanner``
  keeps the loads of every step in flight, so step N's failure report still
  takes a failed block out of its host mirror after step N+1 was planned.
- *draft tokens* (speculative decoding with a draft model or ``ngram_gpu``, which
  vLLM runs asynchronously): the scheduler counts a step's drafts as computed
  until that step's output says how many were rejected, and the worker writes
  the next step from where its KV is valid (before the rejections the scheduler
  has not seen). Only known token ids are published, so every published position
  holds KV a step scheduled no later than the current one writes: an accepted
  draft's verification step, or for the last sampled token the next step that
  runs the request (in flight, or this one: then it lies in this step's blocks).
  A rejected draft's slot lies past every known token. The optimistic count only
  widens the blocks allocated; the blocks it names as written this step may miss
  the one the worker really starts in, but that block's known tokens were written
  by earlier steps, so a partial hit copying them is valid.
- *state checkpoints* (hybrids): a block holds one once the step ending on it
  ran, so a hit on it waits only while *that* step is being scheduled (a step N+1
  hit on step N's checkpoint is copied after step N ran). A decode step's end is
  recorded when it is scheduled, before its last token is sampled: the state
  written there is that of whichever token it is, published once it arrives.

``tests/vllm/test_async_scheduling.py`` checks every read of every step against
the token prefix its slot holds, and, with host and disk tiers whose files are
damaged, that every published slot holds its prefix.

vLLM's block residency metrics (``--kv-cache-metrics``: lifetime, idle time before
eviction, reuse gaps) are recorded on kvbackend's blocks where vLLM's block pool records
its own (``_record_residency``; vLLM's pool is unused).

vLLM's ``KVCacheManager`` surface (``tests/vllm/test_manager_surface.py`` fails
when vLLM adds a public member that this table does not name):

    member                             kvbackend   why
    get_computed_blocks                overridden  token-exact tree match
    allocate_slots                     overridden  open / extend a sequence, publish
    free                               overridden  publish, then release
    cache_blocks                       overridden  publish what is known computed (once a
                                                   load's output is in; after async outputs)
    get_blocks                         overridden  the sequence's block table; for another
                                                   connector, cached blocks carry vLLM's hash
    estimate_cached_tokens             overridden  tokens under the locked node
    usage                              overridden  held blocks of kvbackend's pool
    reset_prefix_cache                 overridden  clears the tree
    take_kv_cache_block_copies         overridden  the step's publishes; copy-on-write
                                                   copies of partial hits, one per group
    new_step_starts                    overridden  copies ran; step's writes are done
    evict_blocks                       overridden  checks no failed block is published
    remove_skipped_blocks              overridden  stops holding the window pages a
                                                   request's windows left (above)
    pop_blocks_for_free                overridden  raises: vLLM's deferral stays off
                                                   (loads out of step order: StepFence)
    finalize_partial_tail_offloads     overridden  Mamba "align" tail hand-offs to a
                                                   connector: none (refused together)
    get_computed_blocks_for_connector  overridden  get_computed_blocks: one logical block
                                                   spans every group, hits never diverge
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
    take_new_block_ids                 overridden  new attention blocks of Mamba / mixed-
                                                   precision models whose pool blocks
                                                   change group (``PagedBlockGroups``),
                                                   for the workers to zero; else []
    record_blocks_for_zeroing          inherited   re-zeroes blocks a failed load left
                                                   unwritten: kvbackend's were zeroed at
                                                   allocation, before the load ran
    take_boundary_state_offloads       inherited   Mamba "align" states for a connector:
                                                   {} (refused together)
    take_events                        overridden  kvbackend's device and tier block
                                                   events, one per KV-cache group
                                                   (``kv_events.py``)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize, KVCacheBlock, KVCacheBlockCopy,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from kvbackend.core import PrefixCache, PrefixMatch, Sequence, TokenBuffer, cdiv
from kvbackend.core.miss_diagnosis import Admission
from kvbackend.core.window_pages import WindowPages
from kvbackend.vllm.block_groups import BlockGroups, PagedBlockGroups, with_block_hashes
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.kv_events import BlockEvents
from kvbackend.vllm.miss_log import MissLog
from kvbackend.vllm.namespace import request_namespace
from kvbackend.vllm.request_options import request_options
from kvbackend.vllm.state_checkpoints import StateCheckpoints
from kvbackend.vllm.state_pages import StatePages
from kvbackend.vllm.step_fence import StepFence
from kvbackend.vllm.step_writes import StepWrites
from kvbackend.vllm.tier_identity import logical_block_size, pages_per_block

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _TrackedRequest:
    """What the manager remembers about one live request."""

    namespace: Any
    block_hashes: list  # vLLM's hashes of the request's full blocks (the request's list)
    tokens: TokenBuffer = field(default_factory=TokenBuffer)
    sequence: Sequence | None = None
    match: PrefixMatch | None = None  # from get_computed_blocks, consumed at admission
    hit_blocks: int = 0  # the whole blocks taken from the cache at admission
    num_published: int = 0  # tokens handed to the tree so far
    loading: bool = False  # an asynchronous load not yet reported: nothing published
    load_step: int = 0  # the step of a synchronous load (0: none); published once it ran
    load_blocks: list[int] = field(default_factory=list)  # the blocks a connector loads into
    load_end: int = 0  # hybrids: the end of a connector's load, a checkpoint once good
    priority: int = 0
    pin: bool = False
    retain_s: float = 0.0  # after the request finishes, keep its context ahead this long
    cacheable: bool = True  # False for multimodal / embedding prompts: token ids don't name them
    window_start: int = 0  # blocks before it: out of the sliding windows (not held in them)


class KVBackendManager(KVCacheManager):
    """A drop-in ``KVCacheManager`` for models with one or several KV-cache groups
    (full attention, sliding windows, Mamba / linear-attention states in "align"
    mode); block ids handed to the tree and pool are logical (``BlockGroups``)."""

    def __init__(self, *args: Any, backend_config: KVBackendConfig,
                 kv_events: BlockEvents | None = None, free_group_pages: bool = True,
                 fence_loads: bool = False, hashed_tables: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_caching = True  # vLLM's own hashing stays off; lookups are ours
        self.block_size = kwargs["scheduler_block_size"]
        self.kv_events = kv_events  # set with --kv-events-config
        # another KV connector tells a table's cached blocks by their hash (``get_blocks``)
        self.hashed_tables = hashed_tables
        self.hash_block_size = kwargs["hash_block_size"]
        # EAGLE / MTP: how many next tokens a drafter's KV at a position reads (else 0)
        self.draft_lookahead = kwargs.get("num_prefill_lookahead", 0)
        num_physical = self.kv_cache_config.num_blocks
        # Mamba / linear-attention hybrids: hits end on a block holding a state checkpoint
        self.state_groups = [g for g, group in enumerate(self.kv_cache_config.kv_cache_groups)
                             if isinstance(group.kv_cache_spec, MambaSpec)]
        full, windowed = (_attention_groups(self.kv_cache_config, self.state_groups)
                          if free_group_pages else ([], []))
        self.windows: WindowPages | None = None
        self.states: StatePages | None = None
        self.checkpoints: StateCheckpoints | None = None
        paged = windowed if not self.state_groups else self.state_groups
        # each group's blocks in one logical block (the scheduler's): more than one where
        # vLLM gave a group a smaller block size; such groups keep every block
        pages = pages_per_block(self.kv_cache_config)
        self._mixed_block_sizes = max(pages) > 1
        if self._mixed_block_sizes and logical_block_size(self.kv_cache_config) != self.block_size:
            raise ValueError(f"the scheduler's block size {self.block_size} is not the least "
                             "common multiple of the KV-cache groups' block sizes")
        if self._mixed_block_sizes and windowed:
            logger.warning("kvbackend: KV-cache groups of different block sizes keep their "
                           "sliding-window blocks for the whole context (vLLM frees those "
                           "out of every window)")
        if (len(full) == 1 and paged and 1 + len(paged) == self.num_kv_cache_groups
                and not self._mixed_block_sizes):
            self.cache = self._prefix_cache(num_physical, backend_config)
            if windowed:
                specs = [self.kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in windowed]
                self.windows = pages = WindowPages(
                    self.cache, len(windowed), max(spec.sliding_window for spec in specs),
                    on_dropped=self._window_dropped)
                in_flight = kwargs.get("max_in_flight_tokens") or self.max_model_len
                # at most this many blocks of a request hold pages (vLLM's admission cap)
                self._max_paged_blocks = max(
                    spec.max_admission_blocks_per_request(in_flight, self.max_model_len)
                    for spec in specs)
            else:
                self.checkpoints = StateCheckpoints(self.block_size, num_physical)
                self.states = StatePages(self.cache, len(paged), self.checkpoints,
                                         on_removed=self._state_removed)
                pages = self.states.pages
                # a hit's checkpoint, a load's last block, and the step's
                self._max_paged_blocks = 3
            self.groups = PagedBlockGroups(num_physical, full[0], paged, pages)
        else:
            self.groups = BlockGroups(num_physical, pages)
            self.watermark_blocks //= self.groups.stride  # vLLM counts physical blocks
            self.cache = self._prefix_cache(self.groups.num_logical, backend_config)
            self._max_paged_blocks = 0
            if self.state_groups:
                self.checkpoints = StateCheckpoints(self.block_size, self.groups.num_logical)
        self._check_max_model_len()
        # The scheduler counts steps; with a KV connector loading out of step order under
        # async scheduling, no load fills a block a step in flight uses
        self.steps = StepFence(self.cache.pool.num_blocks, track=fence_loads)
        # A pool block may serve another group than before: vLLM's workers zero the new
        # attention blocks of such models (stale state bytes may read as NaN)
        self._zero_new_blocks = bool(self.groups.num_paged_groups
                                     and self.kv_cache_config.needs_kv_cache_zeroing)
        self._blocks_to_zero: list[int] = []
        self._requests: dict[str, _TrackedRequest] = {}
        self._written_this_step = StepWrites(self.block_size)
        self._copy_sources: list[int] = []  # partial hits' sources, their window pages held
        # request id -> (request, tokens, step end) scheduled this step, published by
        # _publish_scheduled
        self._scheduled: dict[str, tuple[Request, int, int]] = {}
        self.miss_log = (MissLog(backend_config.explain_misses, self.cache)
                         if backend_config.explain_misses else None)
        self.tier_hit_sources = None  # the tier connector's get_external_cache_hit_sources
        self.hit_tokens = 0  # device tokens reused at admission, all namespaces (monotone)

    # ------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """Token-exact hit, capped at ``num_tokens - 1`` (and the prompt on first admission),
        and for a hybrid the shared-prefix junction (else 0). O(depth + new tokens +
        matched tokens), one more match per same-step fallback."""
        self._publish_scheduled()
        tracked = self._track(request)
        if not tracked.cacheable or not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1
        if request.num_preemptions <= 0:
            limit = min(limit, request.num_prompt_tokens)
        tokens = tracked.tokens.sync(request.all_token_ids)
        match = self._match_clear_of_drafts(tokens, tracked.namespace, limit)
        while match.num_partial_tokens and self._written_this_step.overwrites(
                match.partial_block_id, match.num_partial_tokens):
            # A node higher on the path may hold its own, older copy of that block.
            fallback = max(match.node.start, match.num_full_blocks * self.block_size)
            match = self.cache.match(tokens, tracked.namespace, max_tokens=fallback)
        if self.windows is not None:  # the sliding-window layers read the last window
            hit = self.windows.longest_hit(match.block_ids, match.num_tokens)
            if hit != match.num_tokens:
                match = self.cache.match(tokens, tracked.namespace, max_tokens=hit)
        junction = 0
        if self.checkpoints is not None:  # the state must resume from a checkpoint
            resumable = self.checkpoints.longest_hit(match.block_ids[: match.num_full_blocks])
            if resumable != match.num_tokens:
                # A shared prefix whose end holds no state: vLLM's scheduler ends a chunk
                # on its last whole block, which then holds one for the next sibling.
                shared = match.num_full_blocks * self.block_size
                junction = shared if shared > resumable else 0
                match = self.cache.match(tokens, tracked.namespace, max_tokens=resumable)
        tracked.match = match
        return (self._as_blocks(match.block_ids[: match.num_full_blocks],
                                self._window_start(match.num_tokens)), match.num_tokens, junction)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens under the request's locked node. O(1)."""
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
        """All or nothing; returns only the blocks appended to the request's table and
        records the scheduled tokens for ``_publish_scheduled``. O(depth + blocks) at
        admission, O(new blocks) after."""
        if not (num_new_tokens or num_new_computed_tokens or num_external_computed_tokens):
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        if num_encoder_tokens:
            raise NotImplementedError("kvbackend does not serve encoder-decoder models "
                                      "(refused at start-up)")
        tracked = self._track(request)
        if num_external_computed_tokens and (tracked.sequence is not None or num_new_computed_tokens
                                             % self.block_size):
            raise RuntimeError(f"request {request.request_id}: external tokens must start on a "
                               "block boundary of a newly admitted request; this indicates a bug")
        computed = (request.num_computed_tokens + num_new_computed_tokens
                    + num_external_computed_tokens)
        total = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        margin = reserved_blocks  # blocks to leave allocatable
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if has_scheduled_reqs and waiting:
            margin += self.watermark_blocks
        headroom = self.cache.num_allocatable_blocks - margin
        seq = tracked.sequence
        if seq is None:
            match = self._admission_match(request, tracked, num_new_computed_tokens)
            if self._checkpoint_written_this_step(match):
                return None  # as vLLM: admitted next step, once the checkpoint is written
            needed = total if not full_sequence_must_fit else max(
                total, min(request.num_tokens, self.max_model_len))
            num_new = cdiv(total, self.block_size) - match.num_full_blocks
            # The request's windows read from block `start` on: blocks a KV connector loads
            # before it get no sliding-window pages.
            start = self._window_start(computed)
            paged = self._paged_at_admission(match, start, computed, total,
                                             num_external_computed_tokens)
            if max(self._cost(num_new, len(paged)),
                   self._cost(cdiv(needed, self.block_size) - match.num_full_blocks)) > headroom:
                return None
            if self.miss_log is not None and request.num_preemptions <= 0:
                self._explain_admission(request, tracked, match, num_external_computed_tokens)
            seq = self._open_sequence(request.request_id, tracked, match, total, start, paged)
            if seq is None:
                return None
            loaded = seq.block_ids[(computed - num_external_computed_tokens) // self.block_size:
                                   cdiv(computed, self.block_size)]
            if self.steps.busy(loaded):  # the load may run out of step order: a step later
                self.cache.release(seq)
                tracked.sequence = None
                return None
            tracked.load_blocks = loaded
            tracked.hit_blocks = match.num_full_blocks
            allocated, accessed = seq.block_ids[match.num_full_blocks:], match.block_ids
            copied = match.num_partial_tokens  # slots this step's copy writes
            self.cache.record_query(tracked.namespace, request.num_tokens, match.num_tokens)
            self.hit_tokens += match.num_tokens
            new_block_ids = seq.block_ids  # all of them are new to the request's table
        else:
            self._advance_window(tracked, max(0, computed - request.num_in_flight_tokens))
            num_new = cdiv(total, self.block_size) - len(seq.block_ids)
            # every new block has sliding-window pages; only the step's last one state pages
            num_paged = num_new if self.states is None else min(num_new, 1)
            cost = self._cost(num_new, num_paged)
            if cost > headroom and not self._room_after_dropping_copies(seq, cost, margin):
                return None
            new_block_ids = allocated = self.cache.extend(
                seq, max(total, seq.num_tokens), extra_blocks=self._pages_for(num_paged))
            if new_block_ids is None:
                return None
            if self.windows is not None:
                self.windows.give(allocated, seq.extra_block_ids)
            if self.states is not None:
                step_end = cdiv(min(computed + num_new_tokens, total), self.block_size)
                self.states.advance(request.request_id, seq.block_ids[step_end - 1],
                                    seq.extra_block_ids)
            accessed, copied = (), 0
        # the new blocks' pages in the other groups (sliding-window or state), if any
        self._handed_out(allocated + seq.extra_block_ids, accessed)
        if self._zero_new_blocks:  # attention blocks: the table's, and sliding-window pages
            self._blocks_to_zero += allocated + (seq.extra_block_ids if self.states is None
                                                 else [])
        end = computed + num_new_tokens
        # loads and a partial hit's copy write in this step too
        first_written = computed - num_external_computed_tokens - copied
        self._written_this_step.add(
            seq.block_ids[first_written // self.block_size: cdiv(end, self.block_size)],
            first_written)
        tracked.loading = delay_cache_blocks
        tracked.load_end = computed if num_external_computed_tokens else 0
        if num_external_computed_tokens and not delay_cache_blocks:
            tracked.load_step = self.steps.next_step
        if not (num_external_computed_tokens or self._load_pending(tracked)):
            # (a load is published once known good)
            self._scheduled[request.request_id] = (request, min(end, request.num_tokens), end)
        first_in_window = tracked.window_start if new_block_ids is seq.block_ids else 0
        return self._as_blocks(new_block_ids, first_in_window)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish what is known computed (a load's output, failed blocks included, is in).
        O(depth + tokens) when it publishes, else O(1)."""
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.sequence is not None:
            tracked.loading = False
            if self._load_pending(tracked):  # a synchronous load's step is in flight
                return
            self._publish(request, tracked, min(num_computed_tokens, request.num_tokens))
            if self.checkpoints is not None and 0 < tracked.load_end == num_computed_tokens:
                # a load ends on a checkpoint (the tier planner's hits do), now known good
                self._checkpoint_written(request, tracked, tracked.load_end, known=True)
            tracked.load_end = 0

    def free(self, request: Request) -> None:
        """Publish every computed token (partial tail included; nothing while a load is
        not known good), then release; a finished request with ``kv_retain_s`` leaves
        its context retained. Tokens scheduled in the current step are not computed
        (preempted out of its step): dropped. O(depth + tokens + blocks)."""
        self._scheduled.pop(request.request_id, None)
        if self.miss_log is not None:
            self.miss_log.forget(request.request_id)
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None or tracked.sequence is None:
            return
        if not self._load_pending(tracked):  # else freed while its load ran: may be bad
            self._publish(request, tracked, request.num_computed_tokens, force=True)
        if self.windows is not None:
            self.windows.unhold(tracked.sequence.block_ids[tracked.window_start:])
        if self.states is not None:
            self.states.release(request.request_id)
        retain_s = tracked.retain_s if tracked.cacheable and request.is_finished() else 0
        self.steps.used(tracked.sequence.block_ids, self.steps.scheduled)
        self.cache.release(tracked.sequence, retain_s=retain_s)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        raise NotImplementedError("kvbackend frees at once and keeps loads out of step order "
                                  "off the blocks a step in flight uses (``StepFence``): "
                                  "vLLM's deferral stays off (``Scheduler.defer_block_free``)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Blocks whose external load failed (``kv_load_failure_policy="fail"``).

        Nothing to drop: a request that loads is published to the tree only after
        vLLM has cut its computed tokens back to the first failed block, so no
        tree node lists a failed block. Checked here, O(nodes); a violation is a bug.
        vLLM calls it with one KV-cache group only (block-level load failures with
        several raise in its scheduler), where a block id is a logical one.
        """
        published = self.cache.published_blocks(set(block_ids))
        if published:
            raise RuntimeError(f"block(s) {sorted(published)} failed to load but are published "
                               "in the prefix tree; this indicates a bug")

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """The blocks no sliding window of the request reaches any more stop being held in
        those groups (``WindowPages``; without it every group keeps them). O(blocks)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            self._advance_window(tracked, processed_computed_tokens)

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """Mamba "align" partial tails handed to a KV connector: none (kvbackend's tiers
        save checkpoints themselves, ``TierPlanner``; other connectors are refused with
        state layers)."""
        return []

    def get_computed_blocks_for_connector(
            self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks``: a hit covers every group (one logical block spans all
        of them), so it never diverges between groups."""
        return *self.get_computed_blocks(request), False

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and pin; refused (False) while requests hold blocks.
        O(nodes + blocks)."""
        if self.cache.sequences:
            return False
        self.cache.clear()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.checkpoints is not None:
            self.checkpoints.clear()
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
        tier of each loaded token is known). O(1), plus the record's O(spans)."""
        super().record_prefix_cache_stats(request, num_hits)
        if self.miss_log is not None:
            sources = self.tier_hit_sources or (lambda req, n: {})
            self.miss_log.write(request.request_id, lambda n: sources(request, n))

    def live_failed_loads(self, block_ids: set[int]) -> set[int]:
        """Those of ``block_ids`` (the failed loads the step that just ran reports, or an
        asynchronous load's) that a live request loaded into. Under async scheduling a
        request freed before that report gave its blocks back, and a computing request
        may hold them now: the report is not about it. O(requests + loaded blocks)."""
        live = set()
        for tracked in self._requests.values():
            if tracked.sequence is not None and (
                    tracked.loading or tracked.load_step == self.steps.processed):
                live.update(self.groups.physical(b, 0) for b in tracked.load_blocks)
        return set(block_ids) & live

    # ----------------------------------------------------------- read-outs
    def blocks_to_complete(self, request_id: str, num_tokens: int) -> int:
        """Pool blocks the request still needs to hold ``num_tokens`` tokens (pages in
        other groups included); 0 while it holds none. O(1)."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.sequence is None:
            return 0
        return self._cost(max(0, cdiv(num_tokens, self.block_size)
                              - len(tracked.sequence.block_ids)))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table; with ``hashed_tables``, the blocks it took from the
        cache or published carry vLLM's block hash (a connector pulls into the others,
        ``with_block_hashes``). O(blocks)."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.sequence is None:
            return self.empty_kv_cache_blocks
        blocks = self._as_blocks(tracked.sequence.block_ids, tracked.window_start)
        if not self.hashed_tables:
            return blocks
        hashes = tracked.block_hashes
        if self.hash_block_size != self.block_size:
            hashes = BlockHashListWithBlockSize(hashes, self.hash_block_size, self.block_size)
        cached = max(tracked.hit_blocks, tracked.num_published // self.block_size)
        if cached > len(hashes):
            raise RuntimeError(f"request {request_id}: {cached} cached blocks but vLLM hashed "
                               f"{len(hashes)} (no block hasher?); this indicates a bug")
        return with_block_hashes(blocks, hashes[:cached])

    @property
    def usage(self) -> float:
        """Held blocks over usable ones. O(1)."""
        counts = self.cache.block_counts()
        return counts.held / counts.usable

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The end of a step: its publishes, then the copies for the worker to run before
        its forward pass (their source blocks stay held until the next step starts), and
        the state checkpoints due. O(copies * groups), plus ``_publish_scheduled``'s."""
        self._publish_scheduled()
        taken = self.cache.take_block_copies()
        self.steps.used((c.src for c in taken), self.steps.next_step)  # (dst: a table's)
        copies = self.groups.copies((c.src, c.dst) for c in taken)
        if self.checkpoints is not None:
            physical = self.groups.physical
            copies += [KVCacheBlockCopy(physical(src, g), physical(dst, g))
                       for src, dst in self.checkpoints.take_copies() for g in self.state_groups]
        return copies, []

    def take_new_block_ids(self) -> list[int]:
        """The attention blocks handed out since the last call, for the workers to zero
        before they are written: with pages in other groups (``PagedBlockGroups``) a pool
        block may have held a state page, whose bytes may read as NaN in attention
        (``needs_kv_cache_zeroing``; vLLM zeroes its new attention blocks likewise).
        O(blocks)."""
        ids, self._blocks_to_zero = self._blocks_to_zero, []
        return ids

    def take_events(self) -> list[KVCacheEvent]:
        """This step's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` for the
        device blocks and their tier copies, one per KV-cache group they concern
        (``--kv-events-config``); see ``kv_events.py``. O(events)."""
        return self.kv_events.take() if self.kv_events is not None else []

    def new_step_starts(self) -> None:
        """The previous step ran: release its copies' sources, and the blocks cached
        prefixes hold although a continuation copied them (``drop_redundant_copies``:
        the copies are valid from now on, for the slots a hit reads). O(copies + blocks
        written + prefixes continued in the previous step)."""
        if self._scheduled:
            raise RuntimeError(f"{len(self._scheduled)} request(s) scheduled in the previous "
                               "step were never published; this indicates a bug")
        super().new_step_starts()
        if self.windows is not None:  # before the copies' own holds: they may free them
            self.windows.unhold(self._copy_sources)
            self._copy_sources.clear()
        self.cache.complete_block_copies()  # the previous step, and its copies, have run
        self.cache.drop_redundant_copies()
        if self.checkpoints is not None:
            self.checkpoints.step_starts()
        self._written_this_step.clear()

    # -------------------------------------------------------------- helpers
    def _track(self, request: Request) -> _TrackedRequest:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = _TrackedRequest(request_namespace(request), request.block_hashes)
            options = request_options(request)
            tracked.priority, tracked.pin = options.priority, options.pin
            tracked.retain_s = options.retain_s
            tracked.cacheable = not request.mm_features and request.prompt_embeds is None
            self._requests[request.request_id] = tracked
        return tracked

    def _load_pending(self, tracked: _TrackedRequest) -> bool:
        """Whether a load of the request is not known good yet: an asynchronous one not
        reported, or a synchronous one whose step has not run (async scheduling)."""
        return tracked.loading or not self.steps.has_run(tracked.load_step)

    def _match_clear_of_drafts(self, tokens, namespace, limit: int) -> PrefixMatch:
        """The longest match of ``tokens`` up to ``limit``. With an EAGLE / MTP drafter, whose
        KV at a position also reads the next ``draft_lookahead`` tokens (its writer's), it
        ends that many tokens before the tree's match does: the tree vouches for those
        tokens, so the drafter KV of every hit position read the request's own. O(depth +
        tokens), twice when the lookahead cuts the match."""
        lookahead = self.draft_lookahead
        match = self.cache.match(tokens, namespace, max_tokens=limit + lookahead)
        hit = min(limit, match.num_tokens - lookahead)
        if hit < match.num_tokens:
            match = self.cache.match(tokens, namespace, max_tokens=max(hit, 0))
        return match

    def _admission_match(self, request: Request, tracked: _TrackedRequest, hit: int) -> PrefixMatch:
        """The match ``get_computed_blocks`` returned, re-taken if the tree moved since."""
        match = tracked.match
        if (match is None or match.num_tokens != hit or not self.cache.is_current(match)
                or self.windows is not None):  # (a publish may have replaced its blocks)
            tokens = tracked.tokens.sync(request.all_token_ids)
            match = self.cache.match(tokens, tracked.namespace, max_tokens=hit)
            if match.num_tokens != hit:
                raise RuntimeError(f"request {request.request_id}: the scheduler adopted {hit} "
                                   f"cached tokens but only {match.num_tokens} are cached; "
                                   "this indicates a bug")
        if self.checkpoints is not None and hit and self.checkpoints.longest_hit(
                match.block_ids[: match.num_full_blocks]) != hit:
            raise RuntimeError(f"request {request.request_id}: the scheduler adopted {hit} "
                               "cached tokens, which do not end on a state checkpoint; this "
                               "indicates a bug")
        if self.windows is not None and self.windows.longest_hit(match.block_ids, hit) != hit:
            raise RuntimeError(f"request {request.request_id}: the scheduler adopted {hit} "
                               "cached tokens, whose last window lost its sliding-window pages; "
                               "this indicates a bug")
        return match

    def _handed_out(self, allocated: list[int], accessed=()) -> None:
        """Blocks handed out anew (table blocks and pages) end their previous life: KV
        events, residency metrics, and no state checkpoint there. O(blocks)."""
        if self.kv_events is not None:
            self.kv_events.reused(allocated)
        if self.metrics_collector is not None:
            self._record_residency(allocated, accessed)
        if self.checkpoints is not None:
            self.checkpoints.forget(allocated)

    def _record_residency(self, allocated, accessed) -> None:
        """vLLM's block residency metrics (``--kv-cache-metrics``), on logical blocks as
        vLLM's block pool records them: a block handed out ends its previous life (vLLM
        counts it evicted then) and may start a sampled one; a hit reads its blocks
        (the partial one by its copy). O(blocks)."""
        collector = self.metrics_collector
        for block_id in allocated:
            block = KVCacheBlock(block_id)
            collector.on_block_evicted(block)
            collector.on_block_allocated(block)
        for block_id in accessed:
            collector.on_block_accessed(KVCacheBlock(block_id))

    def _room_after_dropping_copies(self, seq: Sequence, num_blocks: int, margin: int) -> bool:
        """Whether ``num_blocks`` fit (``margin`` kept) once cached prefixes free the
        blocks their continuations copied (``PrefixCache.drop_redundant_copies``, the
        nodes on ``seq``'s locked path included): a request's own locked path may hold
        them, which would preempt it although its blocks fit the pool. (At admission
        ``open_sequence`` drops them itself, after it locked the match.) O(candidates +
        depth * nodes inside a block)."""
        self.cache.drop_redundant_copies(seq)
        return num_blocks <= self.cache.num_allocatable_blocks - margin

    def _checkpoint_written_this_step(self, match: PrefixMatch) -> bool:
        """Whether ``match`` resumes from a state checkpoint the current step writes: the
        workers copy a hit's state before the forward pass, so it is not there yet."""
        return (self.checkpoints is not None and match.num_full_blocks > 0
                and match.block_ids[match.num_full_blocks - 1] in self._written_this_step)

    def _explain_admission(self, request: Request, tracked: _TrackedRequest, match: PrefixMatch,
                           num_external_tokens: int) -> None:
        """Diagnose the first admission for ``explain_misses``, before the request's own
        blocks change the tree. O(prompt tokens)."""
        prompt = tracked.tokens.sync(request.all_token_ids)[: request.num_prompt_tokens]
        admission = Admission(min(request.num_tokens - 1, request.num_prompt_tokens),
                              match.num_tokens, num_external_tokens,
                              lookup=self.prefix_cache_lookup_enabled(request),
                              cacheable=tracked.cacheable,
                              state_checkpoints=self.checkpoints is not None,
                              draft_lookahead=self.draft_lookahead)
        self.miss_log.admitted(request.request_id, tracked.namespace, prompt, admission,
                               self._written_this_step)

    def _publish_scheduled(self) -> None:
        """Publish what this step scheduled so far: no request of it can be preempted out
        of it any more. O(depth + tokens) per request that publishes."""
        for request, num_tokens, end in self._scheduled.values():
            tracked = self._requests[request.request_id]
            self._publish(request, tracked, num_tokens)
            if self.checkpoints is not None and end % self.block_size == 0:
                self._checkpoint_written(request, tracked, end, known=end == num_tokens)
        self._scheduled.clear()

    def _checkpoint_written(self, request: Request, tracked: _TrackedRequest, end: int,
                            known: bool) -> None:
        """A step of ``request`` (or a tier load known good) ends on block boundary
        ``end``: its block there holds a checkpoint, and so will the block the tree
        lists for those tokens, if another (a sibling computed them first), after a copy
        next step; hits on it wait for that step. ``known``: the ids of those tokens are
        (under async scheduling the last one of a decode step is not sampled yet: the
        block then holds a checkpoint for whichever token it is, published once sampled,
        and no sibling's block is looked up). O(depth + end)."""
        index = end // self.block_size - 1
        own = tracked.sequence.block_ids[index]
        self.checkpoints.add(own)
        if self.kv_events is not None:  # its state is announced once its block is
            self.kv_events.state_written(own)
        if not (tracked.cacheable and known):
            return
        listed = self.cache.match(tracked.tokens.sync(request.all_token_ids)[:end],
                                  tracked.namespace, touch=False)
        shared = listed.block_ids[index] if listed.num_full_blocks > index else own
        if shared != own and not self.checkpoints.holds(shared):
            if self.states is None:
                self.checkpoints.copy_to(own, shared)
            else:  # the tree's block may have no state pages: it gets idle ones
                pages = self.states.copy_into(own, shared)
                if pages is None:
                    return
                self._handed_out(pages)
            if self.kv_events is not None:
                self.kv_events.state_written(shared)
            self._written_this_step.add([shared])

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
        if self.windows is not None and num_new < num_tokens - done:
            self._adopt_window_pages(tracked.sequence, tokens)
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

    def _as_blocks(self, block_ids, first_in_window: int = 0) -> KVCacheBlocks:
        if not block_ids:
            return self.empty_kv_cache_blocks
        return self.groups.as_blocks(block_ids, first_in_window)

    # ------------------------------------------- pages in the other groups
    def _prefix_cache(self, num_blocks: int, config: KVBackendConfig) -> PrefixCache:
        return PrefixCache(num_blocks, self.block_size,
                           max_pinned_fraction=config.max_pinned_fraction,
                           max_retained_fraction=config.max_retained_fraction)

    def _check_max_model_len(self) -> None:
        """Refuse a ``max_model_len`` whose request could never fit the pool alone: its
        blocks in every group, or with pages in the other groups (``PagedBlockGroups``) its
        full-attention blocks and at most ``_max_paged_blocks`` pages in each other group
        (sliding windows: vLLM's admission cap; state groups: a hit's, a load's and the
        step's last block)."""
        needed, usable = cdiv(self.max_model_len, self.block_size), self.cache.block_counts().usable
        if self.groups.num_paged_groups:
            pages = self._pages_for(min(needed, self._max_paged_blocks))
            kind = "sliding-window" if self.windows is not None else "state"
            if needed + pages > usable:
                raise ValueError(
                    f"a {self.max_model_len}-token request needs {needed} blocks in the "
                    f"full-attention group and up to {pages} in the "
                    f"{self.groups.num_paged_groups} {kind} groups, the KV cache holds "
                    f"{usable}; lower max_model_len or give the KV cache more memory")
        elif self.groups.num_groups > 1 and usable < needed:
            raise ValueError(
                f"kvbackend keeps every KV-cache group's blocks for the whole context: a "
                f"{self.max_model_len}-token request needs {needed} blocks in each of the "
                f"{self.groups.num_groups} groups, the KV cache holds "
                f"{usable}; lower max_model_len or give the KV "
                "cache more memory")
        if self._mixed_block_sizes and self.max_model_len % self.block_size:
            # vLLM's workers size group g's table to cdiv(max_model_len, its block size)
            raise ValueError(
                f"with KV-cache groups of different block sizes kvbackend needs "
                f"max_model_len to be a multiple of the scheduler's block size "
                f"({self.block_size} tokens), got {self.max_model_len}")

    def _pages_for(self, num_blocks: int) -> int:
        """Pages in the other groups (sliding-window or state) of ``num_blocks`` blocks."""
        return self.groups.num_paged_groups * max(num_blocks, 0)

    def _cost(self, num_blocks: int, num_paged: int | None = None) -> int:
        """Pool blocks that ``num_blocks`` new blocks take, ``num_paged`` of them (by
        default: at most ``_max_paged_blocks``) with their pages in the other groups."""
        if num_paged is None:
            num_paged = min(num_blocks, self._max_paged_blocks)
        return num_blocks + self._pages_for(num_paged)

    def _paged_at_admission(self, match: PrefixMatch, start: int, computed: int, total: int,
                            num_external: int) -> list[int]:
        """The indices of an admitted request's new blocks that get pages in the other
        groups: with sliding windows those from its window ``start`` on; with state
        groups the last block of a tier load (its checkpoint) and of the step."""
        num_blocks = cdiv(total, self.block_size)
        if self.states is not None:
            last = num_blocks - 1
            return sorted({computed // self.block_size - 1, last}) if num_external else [last]
        if self.windows is not None:
            return list(range(max(start, match.num_full_blocks), num_blocks))
        return []

    def _window_start(self, num_tokens: int) -> int:
        return self.windows.window_start(num_tokens) if self.windows is not None else 0

    def _open_sequence(self, request_id: str, tracked: _TrackedRequest, match: PrefixMatch,
                       total: int, start: int, paged: list[int]) -> Sequence | None:
        """``PrefixCache.open_sequence``, the new blocks at indices ``paged`` with their
        pages in the other groups. Held before the pool hands out blocks (so it cannot
        reclaim them): with sliding windows the hit's blocks from ``start`` on, and a
        partial hit's source until its copy ran; with state groups the hit's last block,
        whose checkpoint the request resumes from."""
        windows, states = self.windows, self.states
        source = [match.block_ids[-1]] if match.num_partial_tokens else []
        if windows is not None:
            held = list(match.block_ids[start: match.num_full_blocks]) + source
            windows.hold(held)
        if states is not None:
            states.hold(request_id, match.block_ids[match.num_full_blocks - 1:
                                                    match.num_full_blocks])
        seq = self.cache.open_sequence(match, total, extra_blocks=self._pages_for(len(paged)))
        if seq is None:
            if windows is not None:
                windows.unhold(held)
            if states is not None:
                states.release(request_id)
            return None
        blocks = [seq.block_ids[i] for i in paged]
        if windows is not None:
            windows.give(blocks, seq.extra_block_ids)
            self._copy_sources += source
        if states is not None:
            states.give(request_id, blocks, seq.extra_block_ids)
        tracked.sequence, tracked.match, tracked.window_start = seq, None, start
        return seq

    def _advance_window(self, tracked: _TrackedRequest, num_processed: int) -> None:
        """Stop holding the pages of the blocks that left the request's sliding windows
        (vLLM's ``remove_skipped_blocks``: from ``num_processed`` computed tokens, those
        of in-flight steps excluded). O(blocks left)."""
        seq = tracked.sequence
        if self.windows is None or seq is None:
            return
        start = min(self.windows.window_start(num_processed), len(seq.block_ids))
        if start > tracked.window_start:
            self.windows.unhold(seq.block_ids[tracked.window_start:start])
            tracked.window_start = start

    def _adopt_window_pages(self, seq: Sequence, tokens) -> None:
        """Tokens ``seq`` published were cached already, under blocks that lost their
        sliding-window pages (a hit there was cut back, so ``seq`` recomputed them): the
        tree takes ``seq``'s blocks, which have them, so hits there come back (vLLM
        caches a recomputed block likewise). O(depth + blocks)."""
        has_pages = self.windows.has_pages
        for old, new in self.cache.replace_blocks(
                seq, tokens, lambda old, new: not has_pages(old) and has_pages(new)):
            if self.kv_events is not None:
                self.kv_events.adopted(old, new)

    def _state_removed(self, block_id: int) -> None:
        """``block_id`` holds no state checkpoint any more (``StatePages``)."""
        if self.kv_events is not None:
            self.kv_events.state_removed(block_id)

    def _window_dropped(self, block_id: int) -> None:
        """``WindowPages`` freed ``block_id``'s idle sliding-window pages."""
        if self.kv_events is not None:
            self.kv_events.window_removed(block_id)


def _attention_groups(config: KVCacheConfig, state_groups: list[int]
                      ) -> tuple[list[int], list[int]]:
    """The full-attention and the sliding-window groups, or none of either when another
    kind of group than those and ``state_groups`` (chunked local attention, ...) is
    present."""
    full: list[int] = []
    windowed: list[int] = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windowed.append(g)
        elif isinstance(spec, FullAttentionSpec):
            full.append(g)
        elif g not in state_groups:
            return [], []
    return full, windowed
