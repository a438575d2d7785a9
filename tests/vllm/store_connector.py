"""A KV connector for ``async_harness``: an external store that loads outside the step order.

The store holds the KV of every whole-block prefix of the prompts named in
``kv_connector_extra_config["prompts"]`` and of every finished request's prompt, for
every request whose id does not start with "local". A request loads the longest such
prefix beyond its device hit, synchronously (in its admission step, before the forward
pass) or asynchronously (it waits in WAITING_FOR_REMOTE_KVS until the step's output
reports it), as ``sync_ids`` says.

The worker side writes what a load brings into the ``ContentWorker``'s KV tensor: the id
of each slot's token prefix (``prefixes``, the worker's ``PrefixIds``). A real connector
of this kind (its own copy stream, RDMA) may write a destination at any time once the
step is scheduled; ``AsyncHarness`` checks the scheduler never hands it a block a step
still in flight uses. With ``fail_every=n`` the first load and every n-th after it fail:
one of its blocks, at random, is left unwritten and reported
(``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata,
)

STORE_CONNECTOR = "StoreConnector"


def store_transfer_config(prompts, *, fail_every: int = 0, sync_ids: str = "all",
                          policy: str = "recompute", seed: int = 0) -> dict:
    """``KVTransferConfig`` fields selecting the store. ``sync_ids``: "all", "none", or
    "odd" (requests whose id ends in an odd digit load synchronously)."""
    return {"kv_connector": STORE_CONNECTOR, "kv_role": "kv_both",
            "kv_connector_module_path": __name__, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"prompts": [list(p) for p in prompts],
                                          "fail_every": fail_every, "sync_ids": sync_ids,
                                          "seed": seed}}


@dataclass
class Load:
    request_id: str
    tokens: list[int]  # the request's tokens up to the load's end
    start: int  # the first position loaded (block-aligned)
    block_ids: list[int]  # the blocks positions start.. land in


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class SchedulerSideConnector(KVConnectorBase_V1):
    """A test connector's worker hooks that only its loads would need."""

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class StoreConnector(SchedulerSideConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.block_size = vllm_config.cache_config.block_size
        self.stored = {tuple(p[:end]) for p in extra["prompts"]
                       for end in range(self.block_size, len(p) + 1, self.block_size)}
        self.sync_ids, self.fail_every = extra["sync_ids"], extra["fail_every"]
        self.rng = random.Random(extra["seed"])
        self._planned: dict[str, int] = {}  # request -> its device hit, where its load starts
        self._loads: list[Load] = []
        self.prefixes = None  # the worker's PrefixIds, set by the harness
        self.kv = None
        self.num_loads = 0
        self._errors: set[int] = set()
        self._finished: set[str] = set()

    # ------------------------------------------------------------ scheduler side
    def loads_synchronously(self, request_id: str) -> bool:
        return self.sync_ids == "all" or (self.sync_ids == "odd" and int(request_id[-1]) % 2)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id.startswith("local"):
            return 0, False
        prompt, bs = request.prompt_token_ids, self.block_size
        held = max((end for end in range(bs, request.num_prompt_tokens, bs)
                    if tuple(prompt[:end]) in self.stored), default=0)
        if held <= num_computed_tokens:
            return 0, False
        self._planned[request.request_id] = num_computed_tokens
        return held - num_computed_tokens, not self.loads_synchronously(request.request_id)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if not num_external_tokens:
            return
        start = self._planned.pop(request.request_id)
        end, bs = start + num_external_tokens, self.block_size
        # As NIXL: it loads into the blocks that carry no vLLM hash, those past the hit.
        (block_ids,) = blocks.get_block_ids()
        (unhashed,) = blocks.get_unhashed_block_ids_all_groups()
        assert unhashed == block_ids[start // bs:], (request.request_id, start, block_ids)
        self._loads.append(Load(request.request_id, list(request.all_token_ids[:end]), start,
                                unhashed[: end // bs - start // bs]))

    def request_finished(self, request, block_ids):
        """The store keeps every whole block of a finished request's prompt."""
        prompt, bs = request.prompt_token_ids, self.block_size
        self.stored.update(tuple(prompt[:end]) for end in range(bs, len(prompt) + 1, bs))
        return False, None

    def build_connector_meta(self, scheduler_output):
        meta, self._loads = StoreMetadata(self._loads), []
        return meta

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches):
        self.kv = kv_caches["attn"]

    def start_load_kv(self, forward_context, **kwargs):
        bs = self.block_size
        for load in self._get_connector_metadata().loads:
            self.num_loads += 1
            failed = None
            if self.fail_every and (self.num_loads - 1) % self.fail_every == 0:
                failed = self.rng.choice(load.block_ids)
                self._errors.add(failed)
            ids = self.prefixes.of(load.tokens)
            for p in range(load.start, len(load.tokens)):
                block_id = load.block_ids[(p - load.start) // bs]
                if block_id != failed:
                    self.kv[:, block_id, :, p % bs] = ids[p]
            if not self.loads_synchronously(load.request_id):
                self._finished.add(load.request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_finished(self, finished_req_ids):
        done, self._finished = self._finished, set()
        return None, done or None


__all__ = ["Load", "STORE_CONNECTOR", "SchedulerSideConnector", "StoreConnector", "StoreMetadata",
           "store_transfer_config"]
