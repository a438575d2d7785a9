"""The vLLM scheduler that installs ``KVBackendManager``.

Selected with ``scheduler_cls="kvbackend.vllm.scheduler.KVBackendScheduler"``
(``engine_kwargs`` and ``--kv-backend kvbackend`` set it); it runs in the
engine-core process and reads its configuration from
``VllmConfig.additional_config["kvbackend"]``.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler

from kvbackend.vllm import TIER_CONNECTOR, TIER_CONNECTOR_MODULE
from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, KVBackendConfig
from kvbackend.vllm.manager import KVBackendManager


def is_tier_connector(kv_transfer_config: Any) -> bool:
    """Whether ``kv_transfer_config`` selects kvbackend's own host/disk tier connector."""
    return (kv_transfer_config is not None
            and kv_transfer_config.kv_connector == TIER_CONNECTOR
            and kv_transfer_config.kv_connector_module_path == TIER_CONNECTOR_MODULE)


def unsupported_features(config: VllmConfig) -> list[str]:
    """vLLM features kvbackend cannot serve safely; each is refused at start-up."""
    sched, parallel = config.scheduler_config, config.parallel_config
    checks = {
        "speculative decoding": config.speculative_config is not None,
        "pipeline parallelism": parallel.pipeline_parallel_size > 1,
        "decode/prefill context parallelism": (
            parallel.decode_context_parallel_size > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1),
        "KV connectors other than kvbackend's tier connector (--kv-transfer-config)":
            (config.kv_transfer_config is not None
             and not is_tier_connector(config.kv_transfer_config)),
        "async scheduling (pass --no-async-scheduling)": bool(sched.async_scheduling),
        "priority scheduling (use the default fcfs policy)": sched.policy != "fcfs",
        "encoder-decoder models": config.model_config.is_encoder_decoder,
    }
    return [name for name, present in checks.items() if present]


class KVBackendScheduler(Scheduler):
    """vLLM's ``Scheduler`` with its KV-cache manager replaced by kvbackend's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refused = unsupported_features(self.vllm_config)
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
        )
        if self.connector is not None:  # kvbackend's tier connector (checked above)
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
