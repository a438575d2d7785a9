"""The vLLM scheduler that installs ``KVBackendManager``.

Selected with ``scheduler_cls="kvbackend.vllm.scheduler.KVBackendScheduler"``
(``engine_kwargs`` and ``--kv-backend kvbackend`` set it); it runs in the
engine-core process and reads its configuration from
``VllmConfig.additional_config["kvbackend"]``. vLLM settles async scheduling
only after the scheduler class is named, so the one name builds
``KVBackendAsyncScheduler`` (derived from vLLM's ``AsyncScheduler``) when async
scheduling is on, and ``KVBackendScheduler`` otherwise.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec, EncoderOnlyAttentionSpec, FullAttentionSpec, KVCacheConfig,
    KVCacheSpec, MambaSpec, RSWASpec, SinkFullAttentionSpec, SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, KVBackendConfig
from kvbackend.vllm.connectors import child_configs, connector_refusals, is_tier_connector
from kvbackend.vllm.kv_events import BlockEvents, event_groups
from kvbackend.vllm.manager import KVBackendManager


STATE_LAYERS_REFUSAL = (
    "state layers without block-boundary checkpoints: their state is one running value per "
    "request, not KV per token, so a hit must resume from that state checkpointed exactly at "
    "its end, which kvbackend finds only for Mamba / linear-attention layers in vLLM's "
    "mamba_cache_mode=\"align\" (used where vLLM's prefix caching supports the model; "
    "this one runs them in mode \"none\" or has other state layers)")

UNCHECKED_DRAFTERS_REFUSAL = (
    "speculative decoding with DSpark, multi-module MTP or extract_hidden_states drafters "
    "(their KV is not checked: DSpark, and MTP modules drafting in turn, run only in vLLM's "
    "model runner V2, which needs Triton, absent from the CPU build kvbackend's engine "
    "tests run on; the hidden states extract_hidden_states caches are read by vLLM's "
    "ExampleHiddenStatesConnector, which copies them on CUDA streams; n-gram, suffix, "
    "Medusa, MLP speculators, draft models, EAGLE, EAGLE-3, DFlash and single-module MTP "
    "are served)")

UNCHECKED_LAYERS_REFUSAL = (
    "KV-cache layers kvbackend has not checked, all run only on a GPU: groups vLLM keeps out "
    "of prefix caching or recomputes after every hit (DeepSeek-V4's circular buffers and "
    "bounded-replay sliding-window MLA, HiSparse pages) and static attention sinks "
    "(OpenPangu: their KV sits in fixed blocks of the pool, outside any request)")

MIXED_BLOCK_SIZES_REFUSAL = (
    "KV-cache groups with different block sizes (vLLM gives them to models whose layer "
    "kinds differ in KV bytes per token, such as Gemma 4's sliding-window and "
    "full-attention layers) together with another KV connector than kvbackend's tiers, "
    "KV events or state layers (not done yet: those move or announce one block per group "
    "and logical block)")


def unsupported_features(config: VllmConfig,
                         kv_cache_config: KVCacheConfig | None = None) -> list[str]:
    """vLLM features kvbackend cannot serve safely; each is refused at start-up.

    With ``kv_cache_config`` (known once the workers report their layers) also the
    models whose KV of a prefix is not a function of that prefix alone. KV connectors:
    see ``kvbackend.vllm.connectors``.
    """
    parallel, model = config.parallel_config, config.model_config
    states = kv_cache_config is not None and kv_cache_config.has_mamba_layers
    spec = config.speculative_config
    transfer = config.kv_transfer_config
    checks = {
        # An EAGLE / MTP drafter's KV at a position also reads the next token(s): the
        # manager's hits keep clear of them (``num_prefill_lookahead``). DFlash's context
        # KV reads the target's hidden states only. The others write drafter KV kvbackend
        # has not checked on any engine.
        UNCHECKED_DRAFTERS_REFUSAL:
            spec is not None and spec.uses_draft_kv_cache() and not spec.uses_draft_model()
            and (spec.method not in ("eagle", "eagle3", "mtp", "dflash")
                 or spec.use_multi_module_mtp()),
        "pipeline parallelism": parallel.pipeline_parallel_size > 1,
        "decode/prefill context parallelism": (
            parallel.decode_context_parallel_size > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1),
        "encoder-decoder models": model.is_encoder_decoder,
        # vLLM picks its DiffusionScheduler only when no scheduler class is set.
        "diffusion models (they need vLLM's DiffusionScheduler)":
            model.is_diffusion or config.diffusion_config is not None,
        "models vLLM itself serves without prefix caching (attention-free; pooling with "
        "bidirectional attention or mean/CLS pooling)":
            not model.is_encoder_decoder and not model.is_prefix_caching_supported,
        "non-causal (bidirectional or prefix-LM) attention":
            config.attention_config.use_non_causal
            or (kv_cache_config is not None and _has_non_causal_layers(kv_cache_config)),
        UNCHECKED_LAYERS_REFUSAL: kv_cache_config is not None and any(
            _is_unchecked(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups),
        # README "Mamba / linear-attention hybrids"; the manager's docstring.
        STATE_LAYERS_REFUSAL: kv_cache_config is not None and any(
            not _is_token_kv(g.kv_cache_spec) and not _is_checkpointed_state(g.kv_cache_spec)
            and not _is_unchecked(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups),
        "Mamba / linear-attention hybrids together with speculative decoding (vLLM's "
        "speculative state blocks)": states and spec is not None,
        "Mamba / linear-attention hybrids together with a KV connector other than "
        "kvbackend's tiers (not checked: most move attention KV pages only; NIXL moves state "
        "too, but on the CPU build vLLM's own prefix caching with NIXL already decodes unlike "
        "greedy without cache once the decode instance hits locally)":
            states and not all(map(is_tier_connector, child_configs(transfer))),
        MIXED_BLOCK_SIZES_REFUSAL:
            kv_cache_config is not None and _has_mixed_block_sizes(kv_cache_config)
            and (not all(map(is_tier_connector, child_configs(transfer))) or states
                 or _kv_events_on(config)),
    }
    return [name for name, present in checks.items() if present] + connector_refusals(transfer)


def _kv_events_on(config: VllmConfig) -> bool:
    return config.kv_events_config is not None and config.kv_events_config.enable_kv_cache_events


def _has_non_causal_layers(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a layer's KV is more than a function of the tokens before it. vLLM turns
    prefix caching off for ``non_causal`` specs (prefix-LM layers, in
    ``EngineCore._initialize_kv_caches``), encoder-only layers and R-SWA (whose decode
    KV depends on the window, ``models/config.py``)."""
    return any(getattr(group.kv_cache_spec, "non_causal", False)
               or isinstance(group.kv_cache_spec, (EncoderOnlyAttentionSpec, RSWASpec))
               for group in kv_cache_config.kv_cache_groups)


def _is_unchecked(spec: KVCacheSpec) -> bool:
    """A group vLLM's own prefix caching leaves out or replays after a hit, or static
    attention sinks, whose KV vLLM writes once into blocks 1 .. n of the pool."""
    return (not spec.prefix_cacheable or spec.prefix_replay_tokens > 0
            or isinstance(spec, SinkFullAttentionSpec))


def _is_token_kv(spec) -> bool:
    """Per-token attention KV, a function of the tokens up to each position."""
    return isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))


def _is_checkpointed_state(spec) -> bool:
    """A Mamba / linear-attention group whose workers keep a state per block boundary a
    step ended on (``state_checkpoints.py``)."""
    return isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"


def _has_mixed_block_sizes(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the served groups differ in block size. Other state groups are left out:
    they are refused on their own, and outside "align" mode their one block per request
    spans ``max_model_len``."""
    return len({group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
                if _is_token_kv(group.kv_cache_spec)
                or _is_checkpointed_state(group.kv_cache_spec)}) > 1


class KVBackendScheduler(Scheduler):
    """vLLM's ``Scheduler`` with its KV-cache manager replaced by kvbackend's."""

    def __new__(cls, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> KVBackendScheduler:
        if cls is KVBackendScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = KVBackendAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refused = unsupported_features(self.vllm_config, self.kv_cache_config)
        if refused:
            raise ValueError("kvbackend cannot serve this configuration: " + "; ".join(refused))
        extra = self.vllm_config.additional_config or {}
        tiers_only = all(map(is_tier_connector, child_configs(self.vllm_config.kv_transfer_config)))
        backend_config = KVBackendConfig.from_dict(extra.get(ADDITIONAL_CONFIG_KEY))
        self.kv_cache_manager = KVBackendManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=False,  # vLLM's hash-based cache stays off; kvbackend matches tokens
            log_stats=self.log_stats,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
            num_prefill_lookahead=self.num_prefill_lookahead,
            backend_config=backend_config,
            # another connector reads whole block tables: every group keeps every block
            free_group_pages=tiers_only,
            # vLLM defers frees for every connector that loads; kvbackend keeps those
            # loads off blocks a step in flight uses (its tiers load in step order)
            fence_loads=self.defer_block_free and not tiers_only,
            # another connector tells a request's cached blocks from new ones by their hash
            hashed_tables=not tiers_only,
            kv_events=BlockEvents(self.cache_config.prefix_caching_hash_algo, self.block_size,
                                  event_groups(self.kv_cache_config))
            if self.enable_kv_cache_events else None,
        )
        self.defer_block_free = False  # vLLM's deferral reads its own block pool
        if self.connector is not None:  # kvbackend's tiers and/or a connector checked above
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
            self.kv_cache_manager.tier_hit_sources = self.connector.get_external_cache_hit_sources

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """vLLM's; the manager counts the steps that schedule tokens (``StepFence``)."""
        out = super().schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            self.kv_cache_manager.steps.step_scheduled()
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, Any]:
        """vLLM's, once the manager knows the step ran (its synchronous loads are then
        reported)."""
        if scheduler_output.total_num_scheduled_tokens:
            self.kv_cache_manager.steps.step_processed()
        return super().update_from_output(scheduler_output, model_runner_output)

    def _handle_invalid_blocks(self, invalid_block_ids: set[int],
                               num_scheduled_tokens: dict[str, int]) -> set[str]:
        """vLLM's, for the failed blocks a live request loaded into. Under async
        scheduling a request freed before its step's report gave its blocks back (vLLM's
        deferred frees kept them unused until then; kvbackend hands them to computing
        requests at once): vLLM would cut back, or fail, their new holder for a load it
        never made. The tier connector still sees the whole report."""
        return super()._handle_invalid_blocks(
            self.kv_cache_manager.live_failed_loads(invalid_block_ids), num_scheduled_tokens)

    def _request_remaining_blocks(self, request: Request) -> int:
        """The blocks an in-flight prefill still needs, which vLLM reserves before it admits
        an asynchronous load. vLLM asks its own coordinator, which kvbackend leaves empty:
        it would reserve every such request's whole sequence. A request that holds no
        blocks reserves none: vLLM keeps one whose asynchronous load failed outright
        among its in-flight prefills once it freed it, and its reserve would then count
        against its own admission again (which never fit in a small pool)."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        if self.num_spec_tokens:
            num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens
        return self.kv_cache_manager.blocks_to_complete(request.request_id, num_tokens)

    def add_request(self, request: Request) -> None:
        """vLLM's, then, for a new request that will wait (others queue ahead of it, or
        every running slot is taken), a prefetch of its disk blocks into host memory
        (``KVBackendTierConnector.prefetch``; never raises). Any other request is
        usually admitted in the next step, whose loads read the disk themselves."""
        is_new = request.request_id not in self.requests
        super().add_request(request)
        prefetch = getattr(self.connector, "prefetch", None)
        queued = len(self.waiting) + len(self.kv_holding_waiting)
        if is_new and prefetch is not None and (
                queued > 1 or len(self.running) >= self.max_num_running_reqs):
            prefetch(request)


class KVBackendAsyncScheduler(KVBackendScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvbackend's KV-cache manager (see the manager's
    docstring for what "computed" means while a step is in flight)."""

