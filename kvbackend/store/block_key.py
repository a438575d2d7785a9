"""Content keys for KV blocks: a sha256 chain over the token blocks of a prefix.

    key_0 = H(identity, namespace, ROOT,    n_0, tokens[0:B])
    key_i = H(identity, namespace, key_i-1, n_i, tokens[i*B:(i+1)*B])

with H = sha256 over a fixed, length-prefixed byte encoding (see ``chain_key``)
and token ids as little-endian int32, so keys are the same on every host,
process and Python run (no ``hash()``/``PYTHONHASHSEED``, anchors §1e). A block
holding an id of 2**31 or more (SGLang's multimodal placeholders are 62-bit) is
hashed as little-endian int64 with the top bit of its count set, so it can
neither collide with nor change the key of any block of smaller ids.

Why chaining: a block's KV depends on *every* token before it (attention), so a
key must identify the whole prefix, not just the block's own tokens. Because
``key_i`` hashes ``key_{i-1}``, which hashes ``key_{i-2}``, ..., equal keys
imply (barring a sha256 collision) equal identity, namespace and equal tokens
in *all* blocks 0..i. It costs O(B) per block rather than O(i*B), and the keys
of a prefix are a prefix of the keys: ``keys(t[:k*B]) == keys(t)[:k]``, so a
lookup is "how many leading keys are present" (``TierStore.contains_prefix``).

The identity digest and namespace (tenant salt, LoRA, ...) are hashed into
every link, not only the root, so a key alone says which model/tenant it is for.
Only full blocks get keys: a partial tail is never stored in a tier.

``checkpoint_key(key)`` names a second copy of block ``key`` whose recurrent-state
pages (Mamba / linear-attention layers) hold the state after exactly its last
token: another key for the same tokens, so a tier answers "is there a
checkpoint here" as it answers any lookup, and no payload is ever read as a
checkpoint unless it was saved as one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from kvbackend.core.token_ops import as_token_array

KEY_HEX_LEN = 64
_DOMAIN = b"kvbackend-block-v1\0"
_CHECKPOINT_DOMAIN = b"kvbackend-state-checkpoint-v1\0"
_ROOT = bytes(32)
_INT32_MAX = 2**31 - 1
_WIDE = 1 << 31  # set in the count of a block hashed as int64


def _raw32(hex_digest: str, what: str) -> bytes:
    if len(hex_digest) != KEY_HEX_LEN:
        raise ValueError(f"{what} must be {KEY_HEX_LEN} hex chars, got {len(hex_digest)}")
    try:
        return bytes.fromhex(hex_digest)
    except ValueError:
        raise ValueError(f"{what} is not hex: {hex_digest!r}") from None


def _namespace_bytes(namespace: str | bytes) -> bytes:
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return struct.pack("<I", len(ns)) + ns


def _narrowed(tokens: np.ndarray) -> np.ndarray:
    """``tokens`` as int32 when every id fits (then ``_link`` checks no block). O(n)."""
    return tokens.astype("<i4") if not len(tokens) or tokens.max() <= _INT32_MAX else tokens


def _link(head: bytes, parent_raw: bytes, block_tokens: np.ndarray) -> bytes:
    h = hashlib.sha256(head)
    h.update(parent_raw)
    if block_tokens.itemsize == 4 or not len(block_tokens) or block_tokens.max() <= _INT32_MAX:
        h.update(struct.pack("<I", len(block_tokens)))
        h.update(np.ascontiguousarray(block_tokens, dtype="<i4").tobytes())
    else:
        h.update(struct.pack("<I", len(block_tokens) | _WIDE))
        h.update(np.ascontiguousarray(block_tokens, dtype="<i8").tobytes())
    return h.digest()


def chain_key(
    identity_digest: str, namespace: str | bytes, parent: str | None, block_tokens: np.ndarray,
) -> str:
    """Key of one block: sha256(domain | identity | len(ns) ns | parent | n | tokens).

    ``parent`` is the previous block's key, or ``None`` for the first block.
    ``block_tokens``: any valid token ids (see ``as_token_array``). O(len(block_tokens)).
    """
    head = _DOMAIN + _raw32(identity_digest, "identity digest") + _namespace_bytes(namespace)
    parent_raw = _ROOT if parent is None else _raw32(parent, "parent key")
    return _link(head, parent_raw, as_token_array(block_tokens)).hex()


def checkpoint_key(key: str) -> str:
    """The key of block ``key``'s copy that holds a state checkpoint (module docstring).
    Raises ``ValueError`` for a malformed key. O(1)."""
    return hashlib.sha256(_CHECKPOINT_DOMAIN + _raw32(key, "block key")).hexdigest()


def compute_block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    identity_digest: str,
    namespace: str | bytes = "",
    *,
    parent: str | None = None,
) -> list[str]:
    """Keys of the blocks of ``tokens``: one per full block, in order (a partial tail
    gets none). ``parent`` continues a chain (``tokens`` then starts at a block boundary).
    Raises ``ValueError`` for bad token ids, block size or digests.
    Complexity: O(len(tokens)) time, O(len(tokens) / block_size) extra memory.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    array = _narrowed(as_token_array(tokens))
    head = _DOMAIN + _raw32(identity_digest, "identity digest") + _namespace_bytes(namespace)
    prev = _ROOT if parent is None else _raw32(parent, "parent key")
    num_full = len(array) // block_size
    keys: list[str] = []
    for i in range(num_full):
        prev = _link(head, prev, array[i * block_size:(i + 1) * block_size])
        keys.append(prev.hex())
    return keys
