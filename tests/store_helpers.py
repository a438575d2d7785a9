"""Shared helpers for the store tests (not a test module)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np

from kvbackend.store.identity import CacheIdentity


def make_identity(model: str = "ab" * 32, **overrides) -> CacheIdentity:
    fields = dict(model_fingerprint=model, kv_dtype="bfloat16", block_size=16,
                  kv_layout="layer_first", tp_rank=0, tp_size=1)
    fields.update(overrides)
    return CacheIdentity(**fields)


def key_of(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}block-{i}".encode()).hexdigest()


def payload_for(key: str, size: int = 4096) -> bytes:
    """Deterministic payload derived from the key (so any reader can check it)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def write_safetensors(path, arrays: dict[str, np.ndarray]) -> None:
    """A minimal valid .safetensors file written with numpy only."""
    header, data, offset = {}, [], 0
    for name, arr in arrays.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(data))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, repository importable; a hang raises TimeoutExpired."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


def tree_files(root, suffix: str = "") -> list[str]:
    """Every file (symlinks not followed) under ``root`` whose name ends with ``suffix``."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root)
                  for n in names if n.endswith(suffix))


def damage_file(path: str, rot: bool) -> None:
    """What another process or the disk may do to a block file: flip its last byte
    (``rot``: its checksum fails) or delete it (evicted)."""
    if rot:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x01]))
    else:
        os.unlink(path)
