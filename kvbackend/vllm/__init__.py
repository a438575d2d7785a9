"""kvbackend inside vLLM: the KV-cache manager, its scheduler and the plugin.

Offline use::

    from vllm import LLM
    import kvbackend.vllm
    llm = LLM(model=..., **kvbackend.vllm.engine_kwargs(max_pinned_fraction=0.25))

Server use: ``vllm serve MODEL --kv-backend kvbackend [--kv-backend-config JSON]``.
This module imports vLLM lazily: importing it costs nothing until used.
"""

from __future__ import annotations

from typing import Any

from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, TIER_KEYS, KVBackendConfig

SCHEDULER_CLS = "kvbackend.vllm.scheduler.KVBackendScheduler"
TIER_CONNECTOR = "KVBackendTierConnector"
TIER_CONNECTOR_MODULE = "kvbackend.vllm.tiers.connector"
OPTIONS_VALIDATOR = "kvbackend.vllm.request_options:KVOptionsValidator"


def engine_kwargs(kv_transfer_config: Any = None, **config: Any) -> dict[str, Any]:
    """Plain vLLM keyword arguments that select kvbackend with ``config``.

    Takes the keys of ``--kv-backend-config``; unknown keys raise ValueError.
    ``kv_transfer_config`` (a ``KVTransferConfig`` or its fields) adds another KV
    connector: alone, or with the tier connector in vLLM's ``MultiConnector`` when a
    tier is set (``kvbackend.vllm.connectors.compose`` orders them, and the module says
    which connectors are refused).
    vLLM's own hash-based prefix caching is switched off (kvbackend replaces it).
    A no-op logits processor checks each request's ``kv_priority``/``kv_pin`` in
    the API process (bad values: HTTP 400, or an error from ``LLM.generate``).
    With a host or disk tier configured, kvbackend's tier connector is selected
    as vLLM's KV connector (``kv_transfer_config``); failed tier loads are
    recomputed. vLLM's choice of async scheduling stands (under it every tier hit
    loads asynchronously: the manager's docstring).
    """
    backend_config = KVBackendConfig.from_dict(config)
    kwargs: dict[str, Any] = {
        "scheduler_cls": SCHEDULER_CLS,
        "enable_prefix_caching": False,
        "logits_processors": [OPTIONS_VALIDATOR],
        "additional_config": {ADDITIONAL_CONFIG_KEY: backend_config.to_dict()},
    }
    if backend_config.tiers_enabled:
        kwargs["kv_transfer_config"] = tier_transfer_config(backend_config)
        if kv_transfer_config is not None:
            from kvbackend.vllm.connectors import compose
            kwargs["kv_transfer_config"] = compose(kwargs["kv_transfer_config"],
                                                   kv_transfer_config)
    elif kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs


def tier_transfer_config(backend_config: KVBackendConfig) -> dict[str, Any]:
    """The ``kv_transfer_config`` (as a dict of ``KVTransferConfig`` fields) that
    selects kvbackend's host/disk tier connector."""
    return {
        "kv_connector": TIER_CONNECTOR,
        "kv_connector_module_path": TIER_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {k: getattr(backend_config, k) for k in TIER_KEYS},
    }


__all__ = ["KVBackendConfig", "OPTIONS_VALIDATOR", "SCHEDULER_CLS", "TIER_CONNECTOR",
           "TIER_CONNECTOR_MODULE", "engine_kwargs", "tier_transfer_config"]
