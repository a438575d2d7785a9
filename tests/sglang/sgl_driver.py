"""The scheduler's call sequence on real SGLang pools and requests (not a test module).

``Driver`` admits, decodes, checkpoints, finishes and aborts requests the way
SGLang's scheduler does (Req.init_next_round_input -> match_kv_cache, tree_cache.lock,
the allocator's evict_to_free_tokens, checkpoint_kv_cache, release_kv_cache), on a real
ReqToTokenPool and MHATokenToKVPool on device "cpu" and the allocator SGLang picks for
the page size: TokenToKVPoolAllocator (page_size 1, slots from ``alloc``) or
PagedTokenToKVPoolAllocator (slots from SGLang's alloc_paged_token_slots_extend /
_decode, which continue a row's last page from its last slot), the latter in SGLang's
debug mode (it asserts page alignment and that no page is free twice).
Every computed slot's K value is a fingerprint of (namespace, tokens up to it), so
reading a matched prefix, or any running request's row, checks that the cache hands
out and keeps the right KV.
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
from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens
from sglang.srt.mem_cache.allocation import (
    alloc_paged_token_slots_decode,
    alloc_paged_token_slots_extend,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams


def fingerprint(salt, tokens) -> float:
    digest = hashlib.sha256(repr((salt, list(tokens))).encode()).digest()
    return float(int.from_bytes(digest[:3], "little"))  # exact in float32


class Driver:
    def __init__(self, cache_cls, *, page_size: int = 1, num_slots: int = 96,
                 num_rows: int = 6, max_context_len: int = 64,
                 eviction_policy: str = "lru") -> None:
        self.page_size = page_size
        self.rows = ReqToTokenPool(size=num_rows, max_context_len=max_context_len,
                                   device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=num_slots, page_size=page_size, dtype=torch.float32,
                                   head_num=1, head_dim=1, layer_num=1, device="cpu",
                                   enable_memory_saver=False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(size=num_slots, dtype=torch.float32,
                                                    device="cpu", kvcache=self.kv,
                                                    need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=num_slots, page_size=page_size, dtype=torch.float32, device="cpu",
                kvcache=self.kv, need_sort=False)
            self.allocator.debug_mode = True  # SGLANG_DEBUG_MEMORY_POOL's checks
        self.cache = cache_cls(CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator,
            page_size=page_size, eviction_policy=eviction_policy))
        self.live: dict[str, Req] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------- lifecycle
    def admit(self, tokens, salt=None, priority=None, custom_params=None) -> Req | None:
        """Match, lock, allocate the row and the extend slots, "run" the prefill.
        None (and nothing held) when the pool cannot fit it, as the scheduler would skip it."""
        if not self.rows.free_slots:
            return None
        params = SamplingParams(max_new_tokens=64, custom_params=custom_params)
        req = Req(f"r{next(self._ids)}", "", array("q", tokens), params,
                  cache_salt=salt, priority=priority)
        req.init_next_round_input(self.cache)  # match_kv_cache, capped at len - 1
        req.lock = self.cache.lock(req.last_node)
        prefix = self.cache.prefix_device_indices(req)
        self.check_prefix_kv(req, prefix)
        last_loc = prefix[-1:] if len(prefix) else torch.tensor([-1])
        slots = self._alloc_slots(req.prefix_len, len(tokens), last_loc, decode=False)
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
        """One decode step (one slot) per token; False if the pool is exhausted."""
        return all(self._append(req, [t], decode=True) for t in new_tokens)

    def extend(self, req: Req, new_tokens) -> bool:
        """All of ``new_tokens`` in one extend from the row's end, wherever in a page it
        is (a chunked prefill's next chunk); False, with nothing done, if they do not fit."""
        return self._append(req, new_tokens, decode=False)

    def _append(self, req: Req, new_tokens, *, decode: bool) -> bool:
        start = req.kv.kv_allocated_len
        end = start + len(new_tokens)
        if end > self.rows.req_to_token.shape[1]:
            return False
        row = req.kv.req_pool_idx
        last_loc = self.rows.req_to_token[row, start - 1:start].to(torch.int64)
        slots = self._alloc_slots(start, end, last_loc, decode=decode)
        if slots is None:
            return False
        req.output_ids.extend(int(t) for t in new_tokens)
        req.refresh_fill_ids()
        self.rows.write((row, slice(start, end)), slots.to(torch.int32))
        self._compute(req, start, end)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = end
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

    def _alloc_slots(self, start: int, end: int, last_loc: torch.Tensor, *,
                     decode: bool) -> torch.Tensor | None:
        """Slots for row positions ``[start, end)`` (an extend, or a one-token decode) as
        the scheduler allocates them; ``last_loc`` is the slot at ``start - 1`` ([-1] for
        none). None, with nothing allocated, when the pool cannot fit them even after
        eviction (the scheduler would not have admitted the request, or would retract it)."""
        num = end - start
        if self.page_size == 1:
            self.allocator.evict_to_free_tokens(self.cache, num)
            return self.allocator.alloc(num)
        ps = self.page_size
        new_pages = -(-end // ps) - -(-start // ps)
        self.allocator.evict_to_free_tokens(self.cache, new_pages * ps)
        if self.allocator.available_size() < new_pages * ps:
            return None
        # A batch of one; on "cpu" the device and host length tensors are the same.
        prefix_lens, seq_lens = torch.tensor([start]), torch.tensor([end])
        if decode:
            return alloc_paged_token_slots_decode(self.cache, seq_lens, seq_lens, last_loc)
        return alloc_paged_token_slots_extend(self.cache, prefix_lens, prefix_lens, seq_lens,
                                              seq_lens, last_loc, num)

    # ---------------------------------------------------------------- checks
    def _compute(self, req: Req, start: int, end: int) -> None:
        """The "forward pass": write each new slot's KV fingerprint."""
        ids = req.full_untruncated_fill_ids
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        for pos in range(start, end):
            self.kv.k_buffer[0][int(row[pos])] = fingerprint(req.cache_salt, ids[: pos + 1])

    def check_prefix_kv(self, req: Req, prefix: torch.Tensor) -> None:
        """The matched slots hold the KV of exactly the request's first tokens."""
        self._check_kv(req, req.origin_input_ids, prefix.tolist(), "matched")

    def check_rows_kv(self) -> None:
        """Every running request's row still reads the KV of exactly its tokens."""
        for req in self.live.values():
            row = self.rows.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len]
            self._check_kv(req, req.full_untruncated_fill_ids, row.tolist(), "row")

    def _check_kv(self, req: Req, ids, slots: list[int], what: str) -> None:
        for pos, slot in enumerate(slots):
            got = float(self.kv.k_buffer[0][slot].item())
            assert got == fingerprint(req.cache_salt, ids[: pos + 1]), (
                f"{req.rid}: {what} slot {slot} at position {pos} holds other KV")

    def request_owned(self) -> int:
        """The slots running requests own: whole pages from cache_protected_len on."""
        return sum(kv_private_tokens(r.kv, self.page_size) for r in self.live.values())

    def check_accounting(self) -> None:
        """SGLang's leak check: available + evictable + protected + uncached == total."""
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", available=self.allocator.available_size(),
            evictable=self.cache.evictable_size(), protected=self.cache.protected_size(),
            session_held=0, total=self.allocator.size, uncached=self.request_owned())
        assert not leak, msg
        free = self.allocator.get_all_free_pages().tolist()
        assert len(free) == len(set(free)), "a page was freed twice"
