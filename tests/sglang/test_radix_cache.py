"""Scenario tests: the same scheduler call sequence on SGLang's own RadixCache (the
behavioural reference) and on KVBackendRadixCache, with page sizes 1 and 4."""

import contextlib
import io
import subprocess
import sys
from array import array

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

from sglang.srt.managers.schedule_batch import _compute_pad_values  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from kvbackend.sglang.plugin import BACKEND_NAME, register  # noqa: E402
from kvbackend.sglang.radix_cache import KVBackendRadixCache  # noqa: E402
from tests.sglang.sgl_driver import Driver  # noqa: E402

CACHES = [pytest.param(RadixCache, id="sglang"), pytest.param(KVBackendRadixCache, id="kvbackend")]
page_sizes = pytest.mark.parametrize("page_size", [1, 4], ids=lambda ps: f"page{ps}")


def _check(d: Driver) -> None:
    d.check_accounting()
    d.check_rows_kv()
    if isinstance(d.cache, KVBackendRadixCache):
        d.cache.check_invariants()


def _aligned(d: Driver, num_tokens: int) -> int:
    """What of ``num_tokens`` a page-granular cache keeps."""
    return num_tokens // d.page_size * d.page_size


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_shared_prefix_is_reused_and_duplicates_freed(cache_cls, page_size):
    d = Driver(cache_cls, page_size=page_size)
    a = d.admit(list(range(10)))
    d.decode(a, [50, 51])
    d.checkpoint(a)
    _check(d)
    b = d.admit(list(range(8)) + [70, 71])
    assert b.prefix_len == 8
    d.finish(a)
    d.finish(b)
    _check(d)
    assert d.cache.evictable_size() == 12 + _aligned(d, 10) - 8
    assert d.cache.protected_size() == 0
    c = d.admit(list(range(10)) + [50, 51, 52])
    assert c.prefix_len == 12
    _check(d)
    d.abort(c)
    _check(d)


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_salts_and_extra_keys_never_share(cache_cls, page_size):
    d = Driver(cache_cls, page_size=page_size)
    d.finish(d.admit(list(range(12)), salt="tenant-a"))
    assert d.admit(list(range(12)), salt="tenant-b").prefix_len == 0
    assert d.admit(list(range(12))).prefix_len == 0
    assert d.admit(list(range(13)), salt="tenant-a").prefix_len == 12
    _check(d)


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_eviction_frees_unlocked_lru_leaves_only(cache_cls, page_size):
    d = Driver(cache_cls, page_size=page_size, num_slots=40)
    d.finish(d.admit([1] * 4 + [2] * 8))          # older
    held = d.admit([1] * 4 + [3] * 8)             # locked while running
    d.finish(d.admit([1] * 4 + [4] * 8))          # newer
    _check(d)
    evicted = d.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted
    assert evicted >= 8
    _check(d)
    assert d.admit([1] * 4 + [2] * 9).prefix_len == 4   # the LRU leaf went
    assert d.admit([1] * 4 + [4] * 9).prefix_len == 12  # the newer one stayed
    assert held.prefix_len == 4
    _check(d)


SHARED, A_TAIL, B_TAIL = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [20, 21, 22, 23, 24]


def _branches_inside_a_page(cache_cls) -> Driver:
    """Page size 4, two finished prompts that share 6 tokens (they diverge inside page 1);
    b's branch is the more recently used."""
    d = Driver(cache_cls, page_size=4)
    d.finish(d.admit(SHARED + A_TAIL))
    b = d.admit(SHARED + B_TAIL)
    assert b.prefix_len == 4  # the match stops at the page boundary
    d.finish(b)
    _check(d)
    assert d.cache.evictable_size() == 3 * 4  # page 0, and a copy of page 1 per branch
    return d


@pytest.mark.parametrize("cache_cls", CACHES)
def test_prompts_diverging_inside_a_page_keep_their_own_pages(cache_cls):
    d = _branches_inside_a_page(cache_cls)
    a, b = d.admit(SHARED + A_TAIL + [11]), d.admit(SHARED + B_TAIL + [25])
    assert a.prefix_len == b.prefix_len == 8  # each reads its own copy (the KV check)
    _check(d)
    d.abort(a)
    d.abort(b)
    d.cache.evict(EvictParams(num_tokens=100))
    assert d.cache.evictable_size() == 0 and d.allocator.available_size() == d.allocator.size
    _check(d)


@pytest.mark.parametrize("cache_cls", CACHES)
def test_evicting_one_page_drops_only_the_lru_branch_inside_a_page(cache_cls):
    d = _branches_inside_a_page(cache_cls)
    d.abort(d.admit(SHARED + B_TAIL + [25]))  # b's branch used last
    assert d.cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    _check(d)
    assert d.admit(SHARED + B_TAIL + [25]).prefix_len == 8
    assert d.admit(SHARED + A_TAIL + [11]).prefix_len == 4


@page_sizes
def test_priority_policy_evicts_low_priority_first(page_size):
    d = Driver(KVBackendRadixCache, page_size=page_size, eviction_policy="priority")
    d.finish(d.admit([5] * 8, priority=10))
    d.finish(d.admit([6] * 8, priority=0))
    d.cache.evict(EvictParams(num_tokens=8))
    assert d.admit([5] * 9).prefix_len == 8
    assert d.admit([6] * 9).prefix_len == 0


@page_sizes
def test_pin_survives_eviction(page_size):
    d = Driver(KVBackendRadixCache, page_size=page_size)
    d.finish(d.admit([7] * 10))
    assert d.cache.pin_prefix([7] * 10)
    assert d.cache.protected_size() == _aligned(d, 10)
    assert d.cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 0
    d.cache.unpin_prefix([7] * 10)
    assert d.cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == _aligned(d, 10)
    _check(d)


def test_plugin_registers_factory():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    register()
    register()  # idempotent
    assert get_radix_cache_factory(BACKEND_NAME) is not None


def test_sglang_load_plugins_finds_the_entry_point():
    """A fresh process: SGLang's own plugin loader registers kvbackend from the installed
    ``sglang.srt.plugins`` entry point, with no kvbackend import by the user."""
    script = ("from sglang.srt.plugins import load_plugins\n"
              "from sglang.srt.mem_cache.registry import registered_radix_cache_backends\n"
              f"assert {BACKEND_NAME!r} not in registered_radix_cache_backends()\n"
              "load_plugins()\n"
              f"assert {BACKEND_NAME!r} in registered_radix_cache_backends()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unsupported_policy_is_refused():
    d = Driver(KVBackendRadixCache)
    with pytest.raises(ValueError, match="eviction-policy"):
        KVBackendRadixCache(CacheInitParams(disable=False, req_to_token_pool=d.rows,
                                            token_to_kv_pool_allocator=d.allocator, page_size=1,
                                            eviction_policy="lfu"))


@pytest.mark.parametrize("cache_cls", CACHES)
def test_dfs_weight_order_groups_requests_by_prefix(cache_cls):
    """SGLang's DFS-weight scheduling order over both caches: a permutation of the
    waiting requests in which those sharing a cached prefix sit together."""
    d = Driver(cache_cls)
    d.finish(d.admit([1, 2, 3, 4, 5, 6]))
    d.finish(d.admit([9, 9, 9, 9]))
    waiting = [d.admit(t) for t in ([1, 2, 3, 4, 5, 7], [9, 9, 9, 8], [1, 2, 3, 4, 5, 8],
                                   [9, 9, 9, 7], [4, 4])]
    order = d.cache.dfs_weight_order([r.last_node for r in waiting])
    assert sorted(order) == list(range(len(waiting)))
    groups = [0 if waiting[i].origin_input_ids[0] == 1 else
              1 if waiting[i].origin_input_ids[0] == 9 else 2 for i in order]
    assert groups == sorted(groups, key=groups.index)  # each group contiguous
    _check(d)


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_multimodal_placeholder_ids_are_cached(cache_cls, page_size):
    """SGLang replaces image tokens with 62-bit placeholder ids (MM_PAD_SHIFT_VALUE + a
    hash); a VLM request must be matched and cached like any other."""
    image = list(_compute_pad_values(b"image-1")) * 2
    other = list(_compute_pad_values(b"image-2")) * 2
    assert min(image + other) > 2**40
    d = Driver(cache_cls, page_size=page_size)
    d.finish(d.admit([1, 2, 3, 4] + image + [5, 6, 7, 8]))
    assert d.admit([1, 2, 3, 4] + image + [5, 6, 7, 8, 9]).prefix_len == 16
    assert d.admit([1, 2, 3, 4] + other + [5, 6]).prefix_len == 4
    _check(d)


def _priority_driver(cache_cls, page_size) -> Driver:
    return Driver(cache_cls, page_size=page_size, eviction_policy="priority")


def _cached(d: Driver, tokens) -> int:
    """Tokens of ``tokens`` the cache holds, asked the way the scheduler asks."""
    return d.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))
                                ).device_prefix_len


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_a_continuation_is_evicted_at_its_own_priority(cache_cls, page_size):
    """A priority-0 request continuing a priority-10 one: its new tokens carry priority 0
    and go before a newer priority-0 entry (SGLang's RadixCache is the reference)."""
    d = _priority_driver(cache_cls, page_size)
    first = [1] * 8
    d.finish(d.admit(first, priority=10))
    d.finish(d.admit(first + [2] * 8, priority=0))
    d.finish(d.admit([3] * 8, priority=0))  # newer
    assert d.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8
    assert _cached(d, first + [2] * 8) == 8
    assert _cached(d, [3] * 8) == 8
    _check(d)


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_negative_priorities_are_kept(cache_cls, page_size):
    d = _priority_driver(cache_cls, page_size)
    d.finish(d.admit([1] * 8, priority=0))
    d.finish(d.admit([2] * 8, priority=-3))  # newer, but lower
    assert d.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8
    assert _cached(d, [1] * 8) == 8 and _cached(d, [2] * 8) == 0
    _check(d)


@page_sizes
@pytest.mark.parametrize("cache_cls", CACHES)
def test_outputs_go_before_prompts_of_the_same_priority(cache_cls, page_size):
    """SGLang caches a finished request's prompt at priority + 1 and its output at its
    priority: both outputs go before the older prompt."""
    d = _priority_driver(cache_cls, page_size)
    a, b = d.admit([1] * 8, priority=0), d.admit([2] * 8, priority=0)
    d.decode(a, [5] * 4)
    d.decode(b, [6] * 4)
    d.finish(a)
    d.finish(b)
    evicted = d.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted
    assert evicted == 8
    assert _cached(d, [1] * 8 + [5] * 4) == 8 and _cached(d, [2] * 8 + [6] * 4) == 8
    _check(d)


@page_sizes
def test_pin_twice_then_unpin_twice(page_size):
    d = Driver(KVBackendRadixCache, page_size=page_size)
    d.finish(d.admit([7] * 10))
    assert d.cache.pin_prefix([7] * 8) and d.cache.pin_prefix([7] * 8)
    d.cache.unpin_prefix([7] * 8)
    assert d.cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == _aligned(d, 10) - 8
    d.cache.unpin_prefix([7] * 8)
    assert d.cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 8
    with pytest.raises(ValueError, match="not pinned"):
        d.cache.unpin_prefix([7] * 8)
    _check(d)


@pytest.mark.parametrize("container", [lambda t: array("i", t), lambda t: np.array(t, np.int32),
                                       lambda t: array("q", t), list],
                         ids=["array-i", "numpy-int32", "array-q", "list"])
def test_token_ids_are_read_by_value_whatever_the_container(container):
    d = Driver(KVBackendRadixCache)
    d.finish(d.admit([7, 8, 9, 10, 11]))
    assert d.cache.pin_prefix(container([7, 8, 9, 10]))
    assert d.cache.protected_size() == 4
    d.cache.unpin_prefix(container([7, 8, 9, 10]))
    _check(d)


def test_pretty_print_is_bounded():
    """SGLang prints the tree on out-of-memory paths: a few lines, however big the tree."""
    d = Driver(KVBackendRadixCache, num_slots=20_000, num_rows=4, max_context_len=512)
    for i in range(60):
        d.finish(d.admit([i + 1] * 300))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        d.cache.pretty_print()
    lines = out.getvalue().splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 200, lines[:3]
    assert "60 nodes" in out.getvalue()


def test_kv_events_are_refused_with_the_reason():
    d = Driver(KVBackendRadixCache)
    with pytest.raises(ValueError, match="kv-cache-events|kv_cache_events"):
        KVBackendRadixCache(CacheInitParams(disable=False, req_to_token_pool=d.rows,
                                            token_to_kv_pool_allocator=d.allocator, page_size=1,
                                            enable_kv_cache_events=True))


@pytest.mark.parametrize("flag", ["enable_lmcache", "enable_flexkv"])
def test_lmcache_and_flexkv_are_refused_at_start(flag):
    """SGLang accepts these with any --radix-cache-backend and then calls
    check_hicache_events() every step, which a plain prefix cache cannot serve."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    register()
    d = Driver(KVBackendRadixCache)
    params = CacheInitParams(disable=False, req_to_token_pool=d.rows,
                             token_to_kv_pool_allocator=d.allocator, page_size=1)
    ctx = TreeCacheBuildContext(server_args=None, params=params, is_hybrid_swa=False,
                                is_hybrid_ssm=False, enable_hierarchical_cache=False,
                                disable_radix_cache=False, tp_worker=None, model_config=None,
                                tp_size=1, tp_rank=0, tp_group=None)
    with runtime_context._CONTEXT.override_server_args(radix_cache_backend=BACKEND_NAME):
        assert isinstance(create_tree_cache(ctx), KVBackendRadixCache)
    with runtime_context._CONTEXT.override_server_args(radix_cache_backend=BACKEND_NAME,
                                                       **{flag: True}):
        with pytest.raises(ValueError, match=flag.replace("_", "-")):
            create_tree_cache(ctx)


@page_sizes
def test_kv_retain_s_keeps_a_finished_context_past_newer_ordinary_ones(page_size, caplog):
    """``custom_params={"kv_retain_s": ...}`` (the OpenAI server's ``custom_params``):
    the least recently used context survives an eviction that takes the newer, ordinary
    one; a bad value is ignored with a warning."""
    d = Driver(KVBackendRadixCache, page_size=page_size)
    d.finish(d.admit([5] * 8, custom_params={"kv_retain_s": 600}))
    d.finish(d.admit([6] * 8, custom_params={"kv_retain_s": -1}))
    assert "kv_retain_s must be a finite number" in caplog.text
    d.cache.evict(EvictParams(num_tokens=8))
    assert d.admit([5] * 9).prefix_len == 8
    assert d.admit([6] * 9).prefix_len == 0
    _check(d)
