"""Chained block keys: determinism, prefix property, what the chain covers."""

import hashlib
import struct

import numpy as np
import pytest

from kvbackend.store.block_key import chain_key, compute_block_keys
from tests.store_helpers import make_identity

ID = make_identity().digest()
BS = 4


def test_golden_first_key_pins_the_encoding():
    tokens = [1, 2, 3, 258]
    expected = hashlib.sha256(
        b"kvbackend-block-v1\0" + bytes.fromhex(ID) + struct.pack("<I", 2) + b"ns"
        + bytes(32) + struct.pack("<I", 4) + struct.pack("<4i", *tokens)).hexdigest()
    assert compute_block_keys(tokens, BS, ID, "ns") == [expected]
    assert chain_key(ID, "ns", None, np.array(tokens, np.int32)) == expected


def test_only_full_blocks_get_keys():
    full = compute_block_keys(np.arange(10), BS, ID)
    assert len(full) == 2 and compute_block_keys(np.arange(8), BS, ID) == full
    assert compute_block_keys([], BS, ID) == []


def test_keys_of_a_prefix_are_a_prefix_of_the_keys():
    tokens = np.random.default_rng(0).integers(0, 50_000, 64)
    keys = compute_block_keys(tokens, BS, ID)
    for k in range(len(keys) + 1):
        assert compute_block_keys(tokens[: k * BS], BS, ID) == keys[:k]


def test_chain_identifies_the_whole_prefix():
    a = np.array([1, 2, 3, 4, 9, 9, 9, 9])
    b = np.array([5, 2, 3, 4, 9, 9, 9, 9])  # same second block, different first
    ka, kb = compute_block_keys(a, BS, ID), compute_block_keys(b, BS, ID)
    assert ka[1] != kb[1]


def test_parent_continues_a_chain():
    tokens = np.arange(16)
    keys = compute_block_keys(tokens, BS, ID)
    assert compute_block_keys(tokens[8:], BS, ID, parent=keys[1]) == keys[2:]


def test_namespace_and_identity_change_every_key():
    tokens = np.arange(12)
    base = compute_block_keys(tokens, BS, ID, "tenant-a")
    other_ns = compute_block_keys(tokens, BS, ID, "tenant-b")
    other_id = compute_block_keys(tokens, BS, make_identity(kv_dtype="fp8").digest(), "tenant-a")
    assert not set(base) & set(other_ns) and not set(base) & set(other_id)
    # length prefix: ("ab", tokens) and ("a", ...) cannot collide by concatenation
    assert compute_block_keys(tokens, BS, ID, "ab") != compute_block_keys(tokens, BS, ID, "a")
    assert compute_block_keys(tokens, BS, ID, b"x") == compute_block_keys(tokens, BS, ID, "x")


def test_dtype_and_container_do_not_matter():
    ref = compute_block_keys(list(range(8)), BS, ID)
    assert compute_block_keys(np.arange(8, dtype=np.int64), BS, ID) == ref
    assert compute_block_keys(np.arange(8, dtype=np.int32).astype(">i4"), BS, ID) == ref


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=[-1, 2, 3, 4], block_size=BS, identity_digest=ID), "non-negative|lie in"),
    (dict(tokens=[1, 2], block_size=0, identity_digest=ID), "block_size"),
    (dict(tokens=[1, 2], block_size=BS, identity_digest="abc"), "64 hex"),
    (dict(tokens=[1, 2, 3, 4], block_size=BS, identity_digest=ID, parent="zz" * 32), "not hex"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_block_keys(**kwargs)


def test_ids_above_int32_get_their_own_keys_and_leave_other_blocks_alone():
    """SGLang's multimodal placeholders are 62-bit; an id must never wrap into another,
    and blocks of ids below 2**31 keep the bytes every existing key was made with."""
    small = [1, 2, 3, 4]
    keys = compute_block_keys(small + [2**32 + 1, 2, 3, 4], BS, ID)
    assert keys[0] == compute_block_keys(small, BS, ID)[0]
    assert keys[1] != compute_block_keys(small + [1, 2, 3, 4], BS, ID)[1]
    assert keys[1] != compute_block_keys(small + [2**33 + 1, 2, 3, 4], BS, ID)[1]
    assert chain_key(ID, "", None, np.array([2**62, 5])) != \
        chain_key(ID, "", None, np.array([0, 5]))
