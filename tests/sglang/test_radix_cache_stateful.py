"""Stateful property test: SGLang's scheduler call sequence on KVBackendRadixCache.

Real SGLang objects throughout (Req, ReqToTokenPool, TokenToKVPoolAllocator,
MHATokenToKVPool on "cpu", match via Req.init_next_round_input, checkpoint_kv_cache,
release_kv_cache, the allocator's evict_to_free_tokens; for page size 4 the
paged allocator and SGLang's paged extend/decode allocation). After every step:
SGLang's pool accounting balances, the tree's and page references' invariants
hold, no page is free twice, and every running request's row holds the KV of
exactly its tokens; at every admission the matched slots hold the KV of exactly
the request's tokens, and the match length equals the brute-force longest cached
page-aligned prefix until the first eviction (at most it afterwards).
"""

import pytest

pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

import hypothesis.strategies as st  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from kvbackend.sglang.radix_cache import KVBackendRadixCache, cache_namespace  # noqa: E402
from tests.sglang.sgl_driver import Driver  # noqa: E402
from tests.token_reference import lcp  # noqa: E402

# Few distinct tokens and shared stems, so prompts share prefixes often.
STEMS = [(1, 2, 3, 4), (1, 2, 5), (6,), ()]
prompts = st.builds(lambda stem, tail: list(stem) + tail,
                    st.sampled_from(STEMS), st.lists(st.integers(1, 4), min_size=1, max_size=8))
salts = st.sampled_from([None, None, "a", "b"])


class SGLangLifecycle(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.d = Driver(KVBackendRadixCache, page_size=self.page_size, num_slots=48,
                        num_rows=4, max_context_len=32)
        self.cached: dict = {}  # namespace -> token tuples ever inserted (the model)
        self.evicted = False

    def _evicted_blocks(self) -> int:
        return sum(s.evicted_blocks for s in self.d.cache.tree.stats.values())

    def _aligned(self, num_tokens: int) -> int:
        return num_tokens // self.page_size * self.page_size

    def _record(self, req, length: int) -> None:
        """The request inserted its first ``length`` tokens (the cache keeps whole pages)."""
        ns = cache_namespace(req.extra_key, req.cache_salt)
        tokens = tuple(req.full_untruncated_fill_ids[: self._aligned(length)])
        self.cached.setdefault(ns, set()).add(tokens)

    @rule(tokens=prompts, salt=salts)
    def admit(self, tokens, salt):
        before = self._evicted_blocks()
        ns = cache_namespace(None, salt)
        best = max((lcp(tokens, c) for c in self.cached.get(ns, ())), default=0)
        best = self._aligned(min(best, len(tokens) - 1))
        req = self.d.admit(tokens, salt=salt)
        if req is not None:
            assert req.prefix_len <= best
            if not self.evicted:
                assert req.prefix_len == best, (tokens, salt, req.prefix_len, best)
        # A refused admission may have evicted first (the allocator frees what it can,
        # then finds the pool still short): later matches may be shorter after it too.
        self.evicted |= self._evicted_blocks() > before

    @precondition(lambda self: self.d.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(1, 4), min_size=1, max_size=8),
          one_step=st.booleans())
    def generate(self, data, tokens, one_step):
        """Decode ``tokens`` one step each, or extend them in one step (a chunked
        prefill's next chunk: a paged extend from inside the row's last page)."""
        req = data.draw(st.sampled_from(sorted(self.d.live.values(), key=lambda r: r.rid)))
        before = self._evicted_blocks()
        if one_step:
            self.d.extend(req, tokens)
        else:
            self.d.decode(req, tokens)
        self.evicted |= self._evicted_blocks() > before

    @precondition(lambda self: self.d.live)
    @rule(data=st.data())
    def checkpoint(self, data):
        req = data.draw(st.sampled_from(sorted(self.d.live.values(), key=lambda r: r.rid)))
        self.d.checkpoint(req)
        self._record(req, req.kv.kv_committed_len)
        assert req.kv.cache_protected_len == self._aligned(req.kv.kv_committed_len)

    @precondition(lambda self: self.d.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(sorted(self.d.live.values(), key=lambda r: r.rid)))
        length = req.kv.kv_committed_len
        self.d.finish(req)
        self._record(req, length)

    @precondition(lambda self: self.d.live)
    @rule(data=st.data())
    def abort(self, data):
        self.d.abort(data.draw(st.sampled_from(sorted(self.d.live.values(),
                                                      key=lambda r: r.rid))))

    @rule(num_tokens=st.integers(1, 20))
    def evict(self, num_tokens):
        evictable = self.d.cache.evictable_size()
        freed = self.d.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        assert freed >= min(num_tokens, evictable)
        self.evicted |= freed > 0

    @invariant()
    def consistent(self):
        self.d.check_accounting()
        self.d.check_rows_kv()
        self.d.cache.check_invariants()
        for req in self.d.live.values():  # every running request's locked prefix is cached
            assert req.last_node.num_tokens == req.kv.cache_protected_len


class PagedSGLangLifecycle(SGLangLifecycle):
    """Page size 4: prompts diverge inside pages, so nodes share pages with their parents."""

    page_size = 4


TestSGLangLifecycle = SGLangLifecycle.TestCase
TestSGLangLifecycle.settings = settings(TestSGLangLifecycle.settings, stateful_step_count=40)
TestPagedSGLangLifecycle = PagedSGLangLifecycle.TestCase
TestPagedSGLangLifecycle.settings = settings(TestPagedSGLangLifecycle.settings,
                                             stateful_step_count=40)
