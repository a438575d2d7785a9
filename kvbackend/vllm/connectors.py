"""The vLLM KV connectors kvbackend's device cache works with, and why it refuses the others.

kvbackend's manager drives vLLM's connector calls as vLLM's own manager does: the
connector sees the block-aligned local hit in ``get_num_new_matched_tokens``, gets the
request's whole block table (hit blocks first) in ``update_state_after_alloc``,
``request_finished`` gets the computed blocks, and a request's blocks stay held while the
connector delays their free (``delay_free_blocks``, until its ``finished_sending``). Tokens
a connector loads, synchronously or not, are published to kvbackend's tree only once
vLLM counts them as loaded. In the tables a connector reads (``get_blocks``) the blocks
the request took from the cache or published carry vLLM's block hash, the others none,
as in vLLM's block pool: NIXL tells the blocks it moves into from the local hit that way
(``KVCacheBlocks.get_unhashed_block_ids_all_groups``). What kvbackend does not provide
is vLLM's hash-based block pool itself: vLLM's ``BlockPool`` and coordinator stay
empty. A connector that reads them, or that kvbackend has not run, is refused at start
(``connector_refusals``):

- ``UNSERVED``, each with its reason: vLLM's offloading connector reads its
  coordinator; Mooncake's P/D connector and HF3FS tell the local hit's blocks apart as
  NIXL does, but no test of kvbackend runs them (Mooncake's transfer engine does not
  load without a GPU; HF3FS needs the 3FS file system);
- a connector that overrides ``bind_gpu_block_pool`` or ``bind_kv_cache_manager``
  reads vLLM's block pool or its manager's internals (e.g. the coordinator).

NIXL (prefill/decode disaggregation), pull mode (``NixlConnector``) and push mode
(``NixlPushConnector``), runs on either side: a prefill instance holds a finished
request's blocks, shared cached ones included (never written while a request holds
them), until they were moved; a decode instance receives into the blocks past its local
token-exact hit (it reads them, or names them to the prefill instance, which writes
them), and publishes them once received (``tests/vllm/test_nixl.py``: real engines in
two processes over NIXL's UCX backend; ``tests/vllm/test_nixl_tiers.py``: composed
with kvbackend's host tier on both instances).

kvbackend's own tiers plus other connectors run under vLLM's ``MultiConnector``
(``compose``), which gives a request to the first connector with a hit past the local
one; all save. The tier connector comes first, so a request loads from host/disk/remote
when they hold more than the local hit, else from the others; P/D connectors (NIXL) come
before it, as vLLM orders its own P/D setups: they hit only for a request a prefill
instance computed, whose whole prompt that instance holds, and a partial tier hit would
leave the decode instance to prefill the rest. Under async scheduling a connector that
loads may do so outside the step order: the manager keeps its loads off the blocks a
step in flight uses (``step_fence.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvbackend.vllm import TIER_CONNECTOR, TIER_CONNECTOR_MODULE

MULTI_CONNECTOR = "MultiConnector"
PD_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
_UNCHECKED = ("it would run as NIXL does, but no test of kvbackend runs {} (not checked; "
              "NixlConnector, NixlPullConnector and NixlPushConnector are served)")
UNSERVED = {
    "OffloadingConnector": "it reads vLLM's KV-cache coordinator and block hashes, which "
                           "kvbackend leaves unused (kvbackend's host, disk and remote "
                           "tiers do its job)",
    "MooncakeConnector": _UNCHECKED.format("Mooncake's transfer engine (its wheel links the "
                                           "CUDA driver and libibverbs: no load without a GPU)"),
    "HF3FSKVConnector": _UNCHECKED.format("the 3FS file system"),
}


def is_tier_connector(kv_transfer_config: Any) -> bool:
    """Whether ``kv_transfer_config`` selects kvbackend's own host/disk tier connector."""
    return (kv_transfer_config is not None
            and kv_transfer_config.kv_connector == TIER_CONNECTOR
            and kv_transfer_config.kv_connector_module_path == TIER_CONNECTOR_MODULE)


def child_configs(kv_transfer_config: Any) -> list[Any]:
    """The connectors ``kv_transfer_config`` runs: a ``MultiConnector``'s children (as
    ``KVTransferConfig``), else itself; none for None."""
    if kv_transfer_config is None:
        return []
    if kv_transfer_config.kv_connector != MULTI_CONNECTOR:
        return [kv_transfer_config]
    from vllm.config import KVTransferConfig

    children = (kv_transfer_config.kv_connector_extra_config or {}).get("connectors", [])
    return [KVTransferConfig(**child) for child in children]


def connector_refusals(kv_transfer_config: Any) -> list[str]:
    """Why each connector of ``kv_transfer_config`` cannot run with kvbackend (see the
    module docstring); empty when all can. Loads each connector's class."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    refusals = []
    for child in child_configs(kv_transfer_config):
        name = child.kv_connector
        if is_tier_connector(child):
            continue
        if name in UNSERVED:
            refusals.append(f"KV connector {name}: {UNSERVED[name]}")
            continue
        cls = KVConnectorFactory.get_connector_class(child)
        for hook in ("bind_gpu_block_pool", "bind_kv_cache_manager"):
            if getattr(cls, hook, None) is not getattr(KVConnectorBase_V1, hook):
                refusals.append(f"KV connector {name}: it reads vLLM's block pool or KV-cache "
                                f"manager internals ({hook}), which kvbackend leaves unused")
                break
    return refusals


def transfer_fields(kv_transfer_config: Any) -> dict[str, Any]:
    """The fields a ``KVTransferConfig`` sets away from their defaults, as a dict a
    ``MultiConnector`` child takes (its ``engine_id`` comes from the parent)."""
    if isinstance(kv_transfer_config, dict):
        return dict(kv_transfer_config)
    fields = {}
    for f in dataclasses.fields(kv_transfer_config):
        value = getattr(kv_transfer_config, f.name)
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else f.default)
        if f.name != "engine_id" and value != default:
            fields[f.name] = value
    return fields


def compose(tier: dict[str, Any], other: Any) -> dict[str, Any]:
    """A ``MultiConnector`` config (``KVTransferConfig`` fields) running kvbackend's tier
    connector ``tier`` and ``other`` (a config or its fields; a ``MultiConnector``
    contributes its children): P/D connectors first, then the tier connector, then the
    rest (see the module docstring)."""
    other = transfer_fields(other)
    if other.get("kv_connector") == MULTI_CONNECTOR:
        children = list((other.get("kv_connector_extra_config") or {}).get("connectors", []))
    else:
        children = [other]
    disaggregation = [c for c in children if c.get("kv_connector") in PD_CONNECTORS]
    rest = [c for c in children if c.get("kv_connector") not in PD_CONNECTORS]
    return {"kv_connector": MULTI_CONNECTOR, "kv_role": "kv_both",
            "kv_load_failure_policy": tier["kv_load_failure_policy"],
            "kv_connector_extra_config": {"connectors": [*disaggregation, tier, *rest]}}


__all__ = ["MULTI_CONNECTOR", "UNSERVED", "child_configs", "compose", "connector_refusals",
           "is_tier_connector", "transfer_fields"]
