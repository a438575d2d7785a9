"""gather_blocks / scatter_blocks / copy_blocks: extension == pure-torch fallback == a loop.

Every case runs on both backends (the `backend` fixture); "extension" skips with the
reason when the C++ extension cannot be built. Caches hold random bytes, and results
are compared as bytes, so NaN patterns in float dtypes compare equal.
"""

import itertools

import pytest

torch = pytest.importorskip("torch")

from kvbackend.ops import _extension  # noqa: E402
from kvbackend.ops import (  # noqa: E402
    block_layout,
    copy_blocks,
    extension_available,
    gather_blocks,
    scatter_blocks,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]
# name -> (layer shape given num_blocks, block_dim)
LAYOUTS = {
    "vllm_cpu": (lambda n: (2, n, 4, 16, 8), 1),  # [2, N, H, B, D]
    "blocks_first": (lambda n: (n, 16, 4, 8), 0),  # [N, B, H, D]
    "odd_inner": (lambda n: (2, 3, n, 5), 2),  # 5-element chunks: narrow or byte words
}
NUM_LAYERS = [1, 3]
SIZES = [(4, 1), (33, 17)]  # (num_blocks in the cache, num_ids per call)
CASES = [
    pytest.param(dtype, layout, num_layers, num_blocks, num_ids, seed,
                 id=f"{layout}-{str(dtype)[6:]}-L{num_layers}-N{num_blocks}-n{num_ids}")
    for seed, (dtype, layout, num_layers, (num_blocks, num_ids)) in enumerate(
        itertools.product(DTYPES, LAYOUTS, NUM_LAYERS, SIZES))
]
with_cases = pytest.mark.parametrize("dtype,layout,num_layers,num_blocks,num_ids,seed", CASES)
NO_EXTENSION = "C++ block-copy extension could not be built (see the kvbackend warning)"


@pytest.fixture(params=["torch", "extension"])
def backend(request, monkeypatch):
    """Runs a test on the pure-torch fallback and on the C++ extension."""
    monkeypatch.delenv(_extension.DISABLE_ENV, raising=False)
    if request.param == "torch":
        monkeypatch.setenv(_extension.DISABLE_ENV, "1")
    elif not extension_available():
        pytest.skip(NO_EXTENSION)
    return request.param


def _random_layers(shape, dtype, num_layers, gen):
    """Random bytes (every bit pattern, NaNs included) viewed as `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    byte_shape = (*shape[:-1], shape[-1] * itemsize)
    return [torch.randint(0, 256, byte_shape, dtype=torch.uint8, generator=gen).view(dtype)
            for _ in range(num_layers)]


def _case(layout, dtype, num_layers, num_blocks, seed):
    make_shape, block_dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    return _random_layers(make_shape(num_blocks), dtype, num_layers, gen), block_dim, gen


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _clone(layers):
    return [x.clone() for x in layers]


def _assert_same_bytes(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(_bytes(a.cpu()), _bytes(e.cpu()))


# The reference: plain per-block loops over the original shapes (no byte-view arithmetic).
def _loop_gather(layers, ids, block_dim):
    rows = [_bytes(layer.select(block_dim, b)) for b in ids.tolist() for layer in layers]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.uint8)


def _loop_scatter(flat, layers, ids, block_dim):
    chunk = flat.numel() // max(1, len(ids) * len(layers))
    for i, b in enumerate(ids.tolist()):
        for l, layer in enumerate(layers):
            target = layer.select(block_dim, b)
            start = (i * len(layers) + l) * chunk
            target.copy_(flat[start:start + chunk].view(layer.dtype).view(target.shape))


def _loop_copy(layers, src, dst, block_dim):
    for s, d in zip(src.tolist(), dst.tolist()):
        for layer in layers:
            layer.select(block_dim, d).copy_(layer.select(block_dim, s).clone())


def _copy_pairs(num_blocks, num_pairs, gen):
    """Distinct dst ids; src ids (repeats allowed) from the other blocks."""
    perm = torch.randperm(num_blocks, generator=gen)
    picks = torch.randint(0, num_blocks - num_pairs, (num_pairs,), generator=gen)
    return perm[num_pairs:][picks], perm[:num_pairs]


@with_cases
def test_gather_matches_loop(backend, dtype, layout, num_layers, num_blocks, num_ids, seed):
    layers, block_dim, gen = _case(layout, dtype, num_layers, num_blocks, seed)
    ids = torch.randint(0, num_blocks, (num_ids,), generator=gen)  # repeats allowed
    before = _clone(layers)
    out = gather_blocks(layers, ids, block_dim=block_dim)
    lay = block_layout(layers, block_dim)
    assert out.shape == (num_ids, num_layers, lay.outer, lay.inner) and out.dtype == torch.uint8
    assert torch.equal(out.reshape(-1), _loop_gather(layers, ids, block_dim))
    _assert_same_bytes(layers, before)


@with_cases
def test_scatter_matches_loop(backend, dtype, layout, num_layers, num_blocks, num_ids, seed):
    layers, block_dim, gen = _case(layout, dtype, num_layers, num_blocks, seed)
    ids = torch.randperm(num_blocks, generator=gen)[:num_ids]
    nbytes = num_ids * block_layout(layers, block_dim).block_nbytes
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    expected = _clone(layers)
    _loop_scatter(flat, expected, ids, block_dim)
    scatter_blocks(flat, layers, ids, block_dim=block_dim)
    _assert_same_bytes(layers, expected)


@with_cases
def test_copy_matches_loop(backend, dtype, layout, num_layers, num_blocks, num_ids, seed):
    layers, block_dim, gen = _case(layout, dtype, num_layers, num_blocks, seed)
    src, dst = _copy_pairs(num_blocks, min(num_ids, num_blocks // 2), gen)
    expected = _clone(layers)
    _loop_copy(expected, src, dst, block_dim)
    copy_blocks(layers, src, dst, block_dim=block_dim)
    _assert_same_bytes(layers, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extension_matches_fallback(monkeypatch, dtype):
    if not extension_available():
        pytest.skip(NO_EXTENSION)
    layers, block_dim, gen = _case("vllm_cpu", dtype, num_layers=4, num_blocks=40, seed=7)
    ids = torch.randperm(40, generator=gen)[:20]
    results = {}
    for disabled in ("0", "1"):
        monkeypatch.setenv(_extension.DISABLE_ENV, disabled)
        work = _clone(layers)
        out = gather_blocks(work, ids, block_dim=block_dim)
        scatter_blocks(out.flip(0).contiguous(), work, ids, block_dim=block_dim)
        copy_blocks(work, ids[:10], ids[10:], block_dim=block_dim)
        results[disabled] = (out, work)
    assert torch.equal(results["0"][0], results["1"][0])
    _assert_same_bytes(results["0"][1], results["1"][1])


def test_round_trip_into_user_buffer(backend):
    layers, block_dim, _ = _case("vllm_cpu", torch.bfloat16, num_layers=2, num_blocks=9, seed=3)
    ids = torch.tensor([8, 0, 4])
    out = torch.empty(3 * block_layout(layers, block_dim).block_nbytes // 4, dtype=torch.float32)
    assert gather_blocks(layers, ids, out, block_dim=block_dim) is out
    fresh = [torch.zeros_like(x) for x in layers]
    scatter_blocks(out, fresh, ids, block_dim=block_dim)
    for x, y in zip(layers, fresh):
        assert torch.equal(_bytes(x.index_select(1, ids)), _bytes(y.index_select(1, ids)))
        others = torch.tensor([1, 2, 3, 5, 6, 7])
        assert not _bytes(y.index_select(1, others)).any()


def test_unaligned_layers_and_buffer(backend):
    """Layers and buffers that start at odd byte offsets of their storage."""
    gen = torch.Generator().manual_seed(11)
    shape, block_dim, layer_nbytes = (2, 9, 4, 16), 1, 2 * 9 * 4 * 16
    storage = torch.randint(0, 256, (3 * layer_nbytes + 1,), dtype=torch.uint8, generator=gen)
    layers = [storage[1 + l * layer_nbytes:][:layer_nbytes].view(shape) for l in range(3)]
    ids, src, dst = torch.tensor([7, 2, 5]), torch.tensor([0, 1]), torch.tensor([3, 4])
    out = torch.zeros(3 * 3 * 2 * 64 + 1, dtype=torch.uint8)[1:]
    gather_blocks(layers, ids, out, block_dim=block_dim)
    assert torch.equal(out, _loop_gather(layers, ids, block_dim))
    buffer = torch.zeros_like(storage[:out.numel() + 1])[1:].copy_(out.flip(0))
    expected = _clone(layers)
    _loop_scatter(buffer, expected, ids, block_dim)
    _loop_copy(expected, src, dst, block_dim)
    scatter_blocks(buffer, layers, ids, block_dim=block_dim)
    copy_blocks(layers, src, dst, block_dim=block_dim)
    _assert_same_bytes(layers, expected)


def test_empty_block_list_is_a_no_op(backend):
    layers, block_dim, _ = _case("blocks_first", torch.float16, 2, num_blocks=5, seed=0)
    before = _clone(layers)
    none = torch.empty(0, dtype=torch.int64)
    assert gather_blocks(layers, none, block_dim=block_dim).shape == (0, 2, 1, 16 * 4 * 8 * 2)
    scatter_blocks(torch.empty(0), layers, none, block_dim=block_dim)
    copy_blocks(layers, none, none, block_dim=block_dim)
    _assert_same_bytes(layers, before)


def _bad_calls():
    """(id, call(layers, ids, out), message regex); layers: 2 x [2, 6, 4, 8] fp32, block_dim 1."""
    ids = torch.tensor([0, 5])

    def gather(layers=None, ids=ids, out=None, block_dim=1):
        return lambda ls, o: gather_blocks(ls if layers is None else layers, ids,
                                           o if out is None else out, block_dim=block_dim)

    return [
        ("id_too_large", gather(ids=torch.tensor([0, 6])), r"block id 6 out of range \[0, 6\)"),
        ("id_negative", gather(ids=torch.tensor([-1])), r"block id -1 out of range"),
        ("ids_int32", gather(ids=ids.int()), "must be int64"),
        ("ids_2d", gather(ids=ids.view(1, 2)), r"1-D tensor, got shape \[1, 2\]"),
        ("ids_list", gather(ids=[0, 5]), "must be an int64 CPU tensor"),
        ("block_dim", gather(block_dim=4), r"block_dim must be in \[0, 4\)"),
        ("no_layers", gather(layers=[]), "non-empty"),
        ("shape_mismatch", gather(layers=[torch.zeros(2, 6, 4, 8), torch.zeros(2, 7, 4, 8)]),
         r"layer 1 has shape \[2, 7, 4, 8\], layer 0 has \[2, 6, 4, 8\]"),
        ("dtype_mismatch", gather(layers=[torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 4, 8).bool()]),
         "layer 1 has dtype torch.bool, layer 0 has torch.float32"),
        ("layer_not_contiguous", gather(layers=[torch.zeros(2, 8, 4, 6).transpose(1, 3)]),
         "layer 0 is not contiguous"),
        ("out_wrong_size", gather(out=torch.empty(2, 2, 2, 127, dtype=torch.uint8)),
         "out has 1016 bytes, expected 2 blocks x 512 bytes = 1024"),
        ("out_not_contiguous", gather(out=torch.empty(128, 8, dtype=torch.uint8).t()),
         "out is not contiguous"),
    ]


@pytest.mark.parametrize("call,message", [pytest.param(*c[1:], id=c[0]) for c in _bad_calls()])
def test_bad_inputs_raise(backend, call, message):
    layers = [torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 4, 8)]
    out = torch.empty(2, 2, 2, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        call(layers, out)


def test_bad_scatter_and_copy_ids_raise(backend):
    layers = [torch.zeros(2, 6, 4, 8)]
    before = _clone(layers)
    with pytest.raises(ValueError, match="block_ids repeats block id 3"):
        scatter_blocks(torch.ones(2 * 256), layers, torch.tensor([3, 3]), block_dim=1)
    with pytest.raises(ValueError, match="dst repeats block id 2"):
        copy_blocks(layers, torch.tensor([0, 1]), torch.tensor([2, 2]), block_dim=1)
    with pytest.raises(ValueError, match="block id 2 is both a src and a dst"):
        copy_blocks(layers, torch.tensor([1, 2]), torch.tensor([2, 3]), block_dim=1)
    with pytest.raises(ValueError, match="src has 1 ids, dst has 2"):
        copy_blocks(layers, torch.tensor([1]), torch.tensor([2, 3]), block_dim=1)
    _assert_same_bytes(layers, before)


def test_extension_checks_direct_calls():
    """The C++ TORCH_CHECKs guard callers of torch.ops.kvbackend.* that skip the wrapper."""
    if not extension_available():
        pytest.skip(NO_EXTENSION)
    ops = torch.ops.kvbackend
    layers = [torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 4, 8)]
    out = torch.empty(2, 2, 2, 128, dtype=torch.uint8)
    ids = torch.tensor([0, 1])
    checks = [
        (lambda: ops.gather_blocks(layers, ids + 5, out, 1), "block id 6 out of range"),
        (lambda: ops.gather_blocks(layers, ids.int(), out, 1), "must be int64"),
        (lambda: ops.gather_blocks(layers, ids[:1], out, 1),
         "out has 1024 bytes, expected 1 blocks x 512 bytes = 512"),
        (lambda: ops.gather_blocks(layers, ids, out, 4), r"block_dim must be in \[0, 4\)"),
        (lambda: ops.gather_blocks([layers[0], layers[1][:, :5]], ids, out, 1), "layer 1 has sh"),
        (lambda: ops.gather_blocks([layers[0].transpose(2, 3)], ids, out, 1), "layer 0 is not"),
        (lambda: ops.scatter_blocks(out, layers, torch.tensor([1, 1]), 1), "repeats block id 1"),
        (lambda: ops.copy_blocks(layers, torch.tensor([0, 1]), torch.tensor([1, 2]), 1),
         "block id 1 is both a src and a dst"),
        (lambda: ops.copy_blocks(layers, torch.tensor([0]), torch.tensor([1, 2]), 1),
         "src has 1 ids, dst has 2"),
    ]
    for call, message in checks:
        with pytest.raises(ValueError, match=message):
            call()


def test_disable_env_var(monkeypatch):
    monkeypatch.setenv(_extension.DISABLE_ENV, "1")
    assert not extension_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_matches_loop(backend, dtype, layout):
    if backend == "extension" and not _extension.get().has_cuda:
        pytest.skip("the extension was built without its CUDA kernels")
    layers, block_dim, gen = _case(layout, dtype, num_layers=3, num_blocks=33, seed=5)
    gpu = [x.cuda() for x in layers]
    ids = torch.randperm(33, generator=gen)[:16]
    src, dst = _copy_pairs(33, 8, gen)
    out = gather_blocks(gpu, ids, block_dim=block_dim)
    assert out.is_cuda and torch.equal(out.cpu().reshape(-1), _loop_gather(layers, ids, block_dim))
    flipped = out.flip(0).contiguous()
    scatter_blocks(flipped, gpu, ids, block_dim=block_dim)
    copy_blocks(gpu, src, dst, block_dim=block_dim)
    _loop_scatter(flipped.cpu().reshape(-1), layers, ids, block_dim)
    _loop_copy(layers, src, dst, block_dim)
    _assert_same_bytes(gpu, layers)
