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

from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, KVBackendConfig

SCHEDULER_CLS = "kvbackend.vllm.scheduler.KVBackendScheduler"


def engine_kwargs(**config: Any) -> dict[str, Any]:
    """Plain vLLM keyword arguments that select kvbackend with ``config``.

    Takes the keys of ``--kv-backend-config``; unknown keys raise ValueError.
    vLLM's own hash-based prefix caching is switched off (kvbackend replaces it)
    and so is async scheduling, which kvbackend does not serve.
    """
    backend_config = KVBackendConfig.from_dict(config)
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "additional_config": {ADDITIONAL_CONFIG_KEY: backend_config.to_dict()},
    }


__all__ = ["KVBackendConfig", "SCHEDULER_CLS", "engine_kwargs"]
