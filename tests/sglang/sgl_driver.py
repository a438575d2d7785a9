"""The scheduler's call sequence on real SGLang pools and requests (not a test module).

``Driver`` admits, decodes, checkpoints, finishes and aborts requests the way
SGLang's scheduler does (Req.init_next_round_input -> match_kv_cache, tree_cache.lock, the allocator's
evict_to_free_tokens, checkpoint_kv_cache, release_kv_cache), on a real
ReqToTokenPool, TokenToKVPoolAllocator and MHATokenToKVPool on device "cpu".
Every computed slot's K value is a fingerprint of (namespace, tokens up to it),
so reading a matched prefix checks that the cache hands out the right KV.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.managers.scheduler_components.invariant_checker import (
    SchedulerInvariantChecker,
)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams


def fingerprint(salt, tokens) -> float:
    digest = hashlib.sha256(repr((salt, list(tokens))).encode()).digest()
    return float(int.from_bytes(digest[:3], "little"))  # exact in float32


class Driver:
    def __init__(self, cache_cls, *, num_slots: int = 96, num_rows: int = 6,
                 max_context_len: int = 64, eviction_policy: str = "lru") -> None:
        self.rows = ReqToTokenPool(size=num_rows, max_context_len=max_context_len,
                                   device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=num_slots, page_size=1, dtype=torch.float32, head_num=1,
                                   head_dim=1, layer_num=1, device="cpu",
                                   enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=num_slots, dtype=torch.float32,
                                                device="cpu", kvcache=self.kv, need_sort=False)
        self.cache = cache_cls(CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator,
            page_size=1, eviction_policy=eviction_policy))
        self.live: dict[str, Req] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------- lifecycle
    def admit(self, tokens, salt=None, priority=None) -> Req | None:
        """Match, lock, allocate the row and the extend slots, "run" the prefill.
        None (and nothing held) when the pool cannot fit it, as the scheduler would skip it."""
        if not self.rows.free_slots:
            return None
        req = Req(f"r{next(self._ids)}", "", array("q", tokens), SamplingParams(max_new_tokens=64),
                  cache_salt=salt, priority=priority)
        req.init_next_round_input(self.cache)  # match_kv_cache, capped at len - 1
        req.lock = self.cache.lock(req.last_node)
        prefix = self.cache.prefix_device_indices(req)
        self.check_prefix_kv(req, prefix)
        need = len(tokens) - req.prefix_len
        self.allocator.evict_to_free_tokens(self.cache, need)
        slots = self.allocator.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if slots is None:
            self.cache.unlock(req.lock)
            return None
        self.rows.alloc([req])
        row = req.kv.req_pool_idx
        self.rows.write((row, slice(0, req.prefix_len)), prefix.to(torch.int32))
        self.rows.write((row, slice(req.prefix_len, len(tokens))), slots.to(torch.int32))
        self._compute(req, req.prefix_len, len(tokens))
        req.extend_end = len(tokens)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)
        self.live[req.rid] = req
        return req

    def decode(self, req: Req, new_tokens) -> bool:
        """One slot per generated token; False if the pool is exhausted."""
        for t in new_tokens:
            if req.kv.kv_allocated_len >= self.rows.req_to_token.shape[1]:
                return False
            self.allocator.evict_to_free_tokens(self.cache, 1)
            slot = self.allocator.alloc(1)
            if slot is None:
                return False
            pos = req.kv.kv_allocated_len
            req.output_ids.append(int(t))
            req.refresh_fill_ids()
            self.rows.write((req.kv.req_pool_idx, slice(pos, pos + 1)), slot.to(torch.int32))
            self._compute(req, pos, pos + 1)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
            req.extend_end = pos + 1
        return True

    def checkpoint(self, req: Req) -> None:
        checkpoint_kv_cache(req, self.cache)

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        del self.live[req.rid]

    def abort(self, req: Req) -> None:
        release_kv_cache(req, self.cache, checkpoint=False)
        del self.live[req.rid]

    # ---------------------------------------------------------------- checks
    def _compute(self, req: Req, start: int, end: int) -> None:
        """The "forward pass": write each new slot's KV fingerprint."""
        ids = req.full_untruncated_fill_ids
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        for pos in range(start, end):
            self.kv.k_buffer[0][int(row[pos])] = fingerprint(req.cache_salt, ids[: pos + 1])

    def check_prefix_kv(self, req: Req, prefix: torch.Tensor) -> None:
        ids = req.origin_input_ids
        for pos, slot in enumerate(prefix.tolist()):
            got = float(self.kv.k_buffer[0][slot].item())
            assert got == fingerprint(req.cache_salt, ids[: pos + 1]), (
                f"{req.rid}: matched slot {slot} at position {pos} holds other KV")

    def request_owned(self) -> int:
        return sum(r.kv.kv_allocated_len - r.kv.cache_protected_len for r in self.live.values())

    def check_accounting(self) -> None:
        """SGLang's leak check: available + evictable + protected + uncached == total."""
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", available=self.allocator.available_size(),
            evictable=self.cache.evictable_size(), protected=self.cache.protected_size(),
            session_held=0, total=self.allocator.size, uncached=self.request_owned())
        assert not leak, msg
        free = self.allocator.free_pages.tolist()
        assert len(free) == len(set(free)), "a slot was freed twice"
