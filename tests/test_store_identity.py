"""CacheIdentity digests and model weight fingerprints (real files, no torch)."""

import json
import os

import numpy as np
import pytest

from kvbackend.store.identity import FORMAT_VERSION, CacheIdentity, model_fingerprint
from tests.store_helpers import make_identity, write_safetensors

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1}


def make_model(path, seed: int, fmt: str = "safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    w = np.random.default_rng(seed).standard_normal((8, 8)).astype(np.float32)
    if fmt == "safetensors":
        write_safetensors(path / "model.safetensors", {"w": w})
    else:
        (path / "pytorch_model.bin").write_bytes(w.tobytes())
    return path


@pytest.fixture
def memo(tmp_path):
    return tmp_path / "memo" / "fingerprints.json"


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_same_config_different_weights_differ(tmp_path, memo, fmt):
    a = make_model(tmp_path / "a", seed=1, fmt=fmt)
    b = make_model(tmp_path / "b", seed=2, fmt=fmt)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert model_fingerprint(a, memo_path=memo) != model_fingerprint(b, memo_path=memo)


def test_same_weights_elsewhere_same_fingerprint(tmp_path, memo):
    a = make_model(tmp_path / "a", seed=1)
    b = make_model(tmp_path / "elsewhere" / "b", seed=1)
    fa = model_fingerprint(a, memo_path=memo)
    assert len(fa) == 64 and fa == model_fingerprint(b, memo_path=memo)


def test_config_change_changes_fingerprint(tmp_path, memo):
    a = make_model(tmp_path / "a", seed=1)
    before = model_fingerprint(a, memo_path=memo)
    (a / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=16)))
    assert model_fingerprint(a, memo_path=memo) != before


def test_memo_is_used_and_keyed_by_size_and_mtime(tmp_path, memo):
    a = make_model(tmp_path / "a", seed=1)
    first = model_fingerprint(a, memo_path=memo)
    entries = json.loads(memo.read_text())["files"]
    assert len(entries) == 2  # weights + config
    weights = a / "model.safetensors"
    st = weights.stat()
    # Same size and mtime_ns, different content: the memo answers (proves no re-hash).
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(a, memo_path=memo) == first
    assert model_fingerprint(a, memo_path=memo, refresh=True) != first
    # A new mtime invalidates the memo entry, and the stale entry is dropped.
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_fingerprint(a, memo_path=memo) != first
    assert len(json.loads(memo.read_text())["files"]) == 2


def test_corrupt_memo_is_ignored(tmp_path, memo):
    a = make_model(tmp_path / "a", seed=1)
    expected = model_fingerprint(a, memo_path=False)
    memo.parent.mkdir(parents=True)
    memo.write_text("{not json")
    assert model_fingerprint(a, memo_path=memo) == expected


def test_no_weights_is_an_error(tmp_path, memo):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files"):
        model_fingerprint(tmp_path, memo_path=memo)


def test_identity_digest_covers_every_field():
    base = make_identity()
    variants = [make_identity(model="cd" * 32), make_identity(kv_dtype="float16"),
                make_identity(block_size=32), make_identity(kv_layout="page_first"),
                make_identity(tp_rank=1, tp_size=2), make_identity(tp_size=2),
                make_identity(format_version=FORMAT_VERSION + 1),
                make_identity(extra=(("lora", "x"),))]
    digests = {v.digest() for v in variants}
    assert len(digests) == len(variants) and base.digest() not in digests
    assert base.digest() == make_identity().digest() and len(base.digest()) == 64


def test_identity_roundtrip_and_extra_order():
    a = make_identity(extra=(("pp", "1"), ("lora", "x")))
    b = make_identity(extra=(("lora", "x"), ("pp", "1")))
    assert a == b and a.digest() == b.digest()
    assert CacheIdentity.from_dict(json.loads(json.dumps(a.to_dict()))) == a


@pytest.mark.parametrize("bad, match", [
    (dict(block_size=0), "block_size"),
    (dict(tp_rank=2, tp_size=2), r"tp_rank must lie in \[0, 2\)"),
    (dict(kv_dtype=""), "kv_dtype"), (dict(extra=(("a", "1"), ("a", "2"))), "duplicate"),
])
def test_identity_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        make_identity(**bad)
