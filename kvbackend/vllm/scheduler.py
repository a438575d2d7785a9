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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, KVCacheConfig, RSWASpec

from kvbackend.vllm import TIER_CONNECTOR, TIER_CONNECTOR_MODULE
from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, KVBackendConfig
from kvbackend.vllm.kv_events import DeviceBlockEvents
from kvbackend.vllm.manager import KVBackendManager


def is_tier_connector(kv_transfer_config: Any) -> bool:
    """Whether ``kv_transfer_config`` selects kvbackend's own host/disk tier connector."""
    return (kv_transfer_config is not None
            and kv_transfer_config.kv_connector == TIER_CONNECTOR
            and kv_transfer_config.kv_connector_module_path == TIER_CONNECTOR_MODULE)


def unsupported_features(config: VllmConfig,
                         kv_cache_config: KVCacheConfig | None = None) -> list[str]:
    """vLLM features kvbackend cannot serve safely; each is refused at start-up.

    With ``kv_cache_config`` (known once the workers report their layers) also the
    models whose KV of a prefix is not a function of that prefix alone.
    """
    sched, parallel, model = config.scheduler_config, config.parallel_config, config.model_config
    checks = {
        "speculative decoding": config.speculative_config is not None,
        "pipeline parallelism": parallel.pipeline_parallel_size > 1,
        "decode/prefill context parallelism": (
            parallel.decode_context_parallel_size > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1),
        "KV connectors other than kvbackend's tier connector (--kv-transfer-config)":
            (config.kv_transfer_config is not None
             and not is_tier_connector(config.kv_transfer_config)),
        # Tier loads write device blocks outside the step order async scheduling relies on.
        "async scheduling together with host/disk/remote tiers (pass --no-async-scheduling)":
            bool(sched.async_scheduling) and is_tier_connector(config.kv_transfer_config),
        "priority scheduling (use the default fcfs policy)": sched.policy != "fcfs",
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
    }
    return [name for name, present in checks.items() if present]


def _has_non_causal_layers(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a layer's KV is more than a function of the tokens before it. vLLM turns
    prefix caching off for ``non_causal`` specs (prefix-LM layers, in
    ``EngineCore._initialize_kv_caches``), encoder-only layers and R-SWA (whose decode
    KV depends on the window, ``models/config.py``)."""
    return any(getattr(group.kv_cache_spec, "non_causal", False)
               or isinstance(group.kv_cache_spec, (EncoderOnlyAttentionSpec, RSWASpec))
               for group in kv_cache_config.kv_cache_groups)


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
            backend_config=backend_config,
            kv_events=DeviceBlockEvents(self.cache_config.prefix_caching_hash_algo,
                                        self.block_size) if self.enable_kv_cache_events else None,
        )
        if self.connector is not None:  # kvbackend's tier connector (checked above)
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
            self.kv_cache_manager.tier_hit_sources = self.connector.get_external_cache_hit_sources


class KVBackendAsyncScheduler(KVBackendScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvbackend's KV-cache manager (see the manager's
    docstring for what "computed" means while a step is in flight)."""
