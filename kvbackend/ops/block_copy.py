"""Hot KV block copies, all layers in one call: gather, scatter and copy-on-write.

The KV cache is a list of per-layer tensors of one shape, dtype and device, each
contiguous, whose dimension ``block_dim`` indexes blocks. The ops work on bytes, so
any dtype works (fp32, bf16, fp16, fp8, uint8 ...)::

    layer   uint8 [outer, num_blocks, inner]
            outer = prod(shape[:block_dim])   inner = prod(shape[block_dim+1:]) * itemsize
    buffer  uint8 [num_ids, num_layers, outer, inner]     (contiguous, any dtype)

vLLM's CPU layout ``[2, num_blocks, num_kv_heads, block_size, head_size]`` is
``block_dim=1`` (outer 2: K then V); ``[num_blocks, block_size, num_heads, head_size]``
is ``block_dim=0``. Row ``buffer[i]`` (``block_nbytes`` bytes) holds block
``block_ids[i]`` of every layer, so a host tier can keep each row as one block.

Block ids are int64 CPU tensors (range checks then need no device sync). Each op runs in
the C++/CUDA extension (``csrc/``, built on first use) or, when that is unavailable or
``KVBACKEND_DISABLE_EXTENSION=1``, in the pure-torch fallback below; both give the same
bytes. Misuse raises ValueError before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvbackend.ops import _extension


class BlockLayout(NamedTuple):
    """Byte geometry of a KV cache; see the module docstring."""

    num_layers: int
    outer: int
    num_blocks: int
    inner: int  # bytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers: one row of the buffer."""
        return self.num_layers * self.outer * self.inner


def extension_available() -> bool:
    """True if the C++ extension is loaded (building it on the first call) and not disabled."""
    return _extension.get() is not None


def block_layout(kv_layers: Sequence[torch.Tensor], block_dim: int) -> BlockLayout:
    """Check the layers and return their byte geometry. Complexity: O(num_layers)."""
    if not isinstance(kv_layers, (list, tuple)) or not kv_layers:
        raise ValueError(f"kv_layers must be a non-empty list of tensors, got {kv_layers!r:.80}")
    first = kv_layers[0]
    for l, layer in enumerate(kv_layers):
        if not isinstance(layer, torch.Tensor):
            raise ValueError(f"layer {l} is a {type(layer).__name__}, not a tensor")
        if layer.device != first.device:
            raise ValueError(f"layer {l} is on {layer.device}, layer 0 on {first.device}")
        if layer.dtype != first.dtype:
            raise ValueError(f"layer {l} has dtype {layer.dtype}, layer 0 has {first.dtype}")
        if layer.shape != first.shape:
            raise ValueError(f"layer {l} has shape {list(layer.shape)}, "
                             f"layer 0 has {list(first.shape)}")
        if not layer.is_contiguous():
            raise ValueError(f"layer {l} is not contiguous")
    if not isinstance(block_dim, int) or not 0 <= block_dim < first.dim():
        raise ValueError(f"block_dim must be in [0, {first.dim()}) for layers of shape "
                         f"{list(first.shape)}, got {block_dim!r}")
    shape = first.shape
    return BlockLayout(len(kv_layers), math.prod(shape[:block_dim]), shape[block_dim],
                       math.prod(shape[block_dim + 1:]) * first.element_size())


class BlockCopier:
    """Gathers and scatters whole blocks of one KV cache whose layers were checked once.

    For callers that move blocks of the same cache call after call (``BlockMover``): a
    call then checks only its ids and buffer, O(num_ids) instead of O(num_layers) Python
    work (about 55 us per call on 32 layers). The layers must not be replaced or resized
    afterwards. ``gather_blocks`` / ``scatter_blocks`` are one-call copiers.
    """

    def __init__(self, kv_layers: Sequence[torch.Tensor], block_dim: int) -> None:
        self.layout = block_layout(kv_layers, block_dim)
        self.layers, self.block_dim = list(kv_layers), block_dim
        self.device = self.layers[0].device

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out[i, l]`` = block ``block_ids[i]`` of layer l; see ``gather_blocks``."""
        layout = self.layout
        ids = _check_ids(block_ids, "block_ids", layout.num_blocks, distinct=False)
        if out is None:
            shape = (len(ids), layout.num_layers, layout.outer, layout.inner)
            out = torch.empty(shape, dtype=torch.uint8, device=self.device)
        _check_buffer(out, "out", layout, len(ids), self.device)
        ops = _extension_ops(self.device)
        if ops is not None:
            ops.gather_blocks(self.layers, ids, out, self.block_dim)
            return out
        views, rows = _word_views(layout, self.layers, out, len(ids))
        ids = ids.to(self.device)
        for l, view in enumerate(views):
            rows[:, l].copy_(view.index_select(1, ids).transpose(0, 1))
        return out

    def scatter(self, buffer: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Block ``block_ids[i]`` of layer l = ``buffer[i, l]``; see ``scatter_blocks``."""
        layout = self.layout
        ids = _check_ids(block_ids, "block_ids", layout.num_blocks, distinct=True)
        _check_buffer(buffer, "buffer", layout, len(ids), self.device)
        ops = _extension_ops(self.device)
        if ops is not None:
            ops.scatter_blocks(buffer, self.layers, ids, self.block_dim)
            return
        views, rows = _word_views(layout, self.layers, buffer, len(ids))
        ids = ids.to(self.device)
        for l, view in enumerate(views):
            view.index_copy_(1, ids, rows[:, l].transpose(0, 1))


def gather_blocks(kv_layers: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None, *, block_dim: int) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into ``out[i, l] = layer l, block block_ids[i]``.

    Args:
        kv_layers: the per-layer cache tensors.
        block_ids: int64 CPU ``[num_ids]``, each in ``[0, num_blocks)``; repeats allowed.
        out: contiguous, on the cache's device, ``num_ids * block_nbytes`` bytes of any
            dtype; None allocates uint8 ``[num_ids, num_layers, outer, inner]``.
        block_dim: the dimension of each layer that indexes blocks.
    Returns:
        ``out``. Complexity: O(num_ids * block_nbytes) bytes moved.
    """
    return BlockCopier(kv_layers, block_dim).gather(block_ids, out)


def scatter_blocks(buffer: torch.Tensor, kv_layers: Sequence[torch.Tensor],
                   block_ids: torch.Tensor, *, block_dim: int) -> None:
    """Inverse of ``gather_blocks``: layer l, block ``block_ids[i]`` = ``buffer[i, l]``.

    ``block_ids`` must be distinct (int64 CPU ``[num_ids]``); ``buffer`` is contiguous,
    on the cache's device, ``num_ids * block_nbytes`` bytes. Other blocks are untouched.
    Complexity: O(num_ids * block_nbytes) bytes moved.
    """
    BlockCopier(kv_layers, block_dim).scatter(buffer, block_ids)


def copy_blocks(kv_layers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor,
                *, block_dim: int) -> None:
    """Copy-on-write: in every layer, block ``dst[k]`` = block ``src[k]`` (whole blocks).

    ``src`` and ``dst`` are int64 CPU ``[num_pairs]``; ``dst`` ids are distinct and none
    is also a ``src`` id, so the pairs are independent. Copying whole blocks covers
    a ``BlockCopy`` of its first ``num_tokens`` slots. Complexity: O(num_pairs * block_nbytes).
    """
    layout = block_layout(kv_layers, block_dim)
    src = _check_ids(src, "src", layout.num_blocks, distinct=False)
    dst = _check_ids(dst, "dst", layout.num_blocks, distinct=True)
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} ids, dst has {len(dst)}")
    both = torch.isin(src, dst)
    if bool(both.any()):
        raise ValueError(f"block id {int(src[both][0])} is both a src and a dst")
    device = kv_layers[0].device
    ops = _extension_ops(device)
    if ops is not None:
        ops.copy_blocks(list(kv_layers), src, dst, block_dim)
        return
    src, dst = src.to(device), dst.to(device)
    for view in _word_views(layout, kv_layers)[0]:
        view.index_copy_(1, dst, view.index_select(1, src))


def _extension_ops(device: torch.device) -> Any:
    """The extension's ops if they serve ``device``, else None (use the fallback)."""
    ext = _extension.get()
    if ext is None or device.type not in ("cpu", "cuda"):
        return None
    return ext.ops if device.type == "cpu" or ext.has_cuda else None


_WORDS = [(8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)]


def _word_views(layout: BlockLayout, kv_layers: Sequence[torch.Tensor],
                buffer: torch.Tensor | None = None,
                num_ids: int = 0) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Views of checked layers as ``[outer, num_blocks, inner / word]`` and of the buffer as
    ``[num_ids, num_layers, outer, inner / word]``, in the widest integer word that divides
    ``inner`` and every byte offset (as the CUDA kernels do; index_copy_ moves elements).
    """
    tensors = [*kv_layers, *([] if buffer is None else [buffer])]
    word, dtype = next((size, dtype) for size, dtype in _WORDS if layout.inner % size == 0 and
                       all(t.storage_offset() * t.element_size() % size == 0 for t in tensors))

    def words(t: torch.Tensor, *shape: int) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8).view(dtype).view(*shape, layout.inner // word)

    views = [words(layer, layout.outer, layout.num_blocks) for layer in kv_layers]
    rows = None if buffer is None else words(buffer, num_ids, layout.num_layers, layout.outer)
    return views, rows


def _check_ids(ids: torch.Tensor, name: str, num_blocks: int, *, distinct: bool) -> torch.Tensor:
    """Check a block-id vector. Complexity: O(n), or O(n log n) with ``distinct``."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be an int64 CPU tensor, got {type(ids).__name__}")
    if ids.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if ids.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {ids.device}")
    if ids.dim() != 1 or not ids.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {list(ids.shape)}")
    bad = (ids < 0) | (ids >= num_blocks)
    if bool(bad.any()):
        raise ValueError(f"{name} holds block id {int(ids[bad][0])} out of range [0, {num_blocks})")
    if distinct and len(ids) > 1:
        ordered = ids.sort().values
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(repeated):
            raise ValueError(f"{name} repeats block id {int(repeated[0])}")
    return ids


def _check_buffer(buffer: torch.Tensor, name: str, layout: BlockLayout, num_ids: int,
                  device: torch.device) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(buffer).__name__}")
    if buffer.device != device:
        raise ValueError(f"{name} is on {buffer.device}, the layers on {device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} is not contiguous")
    expected = num_ids * layout.block_nbytes
    if buffer.nbytes != expected:
        raise ValueError(f"{name} has {buffer.nbytes} bytes, expected {num_ids} blocks x "
                         f"{layout.block_nbytes} bytes = {expected}")
