"""What a stored KV block was computed *by*: model weights, dtype, layout, parallelism.

A KV block is a function of (token ids, model weights, kv dtype, block size,
memory layout, tensor-parallel shard). The token ids go into the block key
(:mod:`kvbackend.store.block_key`); everything else is a :class:`CacheIdentity`,
whose digest namespaces the on-disk tree and is part of every block key. Getting
this wrong is the recurring bug of existing systems (anchors §1e, §5e: SGLang
HiCache keyed L3 pages by model *name*, so two checkpoints under one name read
each other's KV; dtype and salt were missing too).

``model_fingerprint`` hashes the weight files' *contents*, not the model's name
or path, so two checkpoints with the same config but different weights never
share a fingerprint, while two copies of one checkpoint in different
directories do. Hashing a 10 GB checkpoint takes seconds, so the per-file
digests are memoized in a sidecar JSON keyed by (real path, size, mtime_ns).
Caveat: a file rewritten in place with the same size *and* mtime_ns (e.g. by a
tool that restores timestamps) keeps its old digest; pass ``refresh=True`` then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvbackend.store.block_file import FORMAT_VERSION

logger = logging.getLogger("kvbackend.store")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
CONFIG_FILE = "config.json"
_CHUNK = 8 << 20
_MEMO_VERSION = 1


@dataclass(frozen=True)
class CacheIdentity:
    """Everything besides the tokens that a KV block's bytes depend on.

    ``extra`` holds further (name, value) pairs that change the KV bytes, e.g.
    a pipeline stage or a LoRA adapter fingerprint; it is sorted on creation so
    the digest does not depend on the order given.
    """

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    kv_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "kv_dtype", "kv_layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank must lie in [0, {self.tp_size}), got {self.tp_rank!r}")
        extra = tuple(sorted((str(k), str(v)) for k, v in self.extra))
        if len({k for k, _ in extra}) != len(extra):
            raise ValueError(f"extra has duplicate names: {[k for k, _ in extra]}")
        object.__setattr__(self, "extra", extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["extra"] = [list(pair) for pair in self.extra]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CacheIdentity:
        d = dict(d)
        d["extra"] = tuple(tuple(pair) for pair in d.get("extra", ()))
        return cls(**d)

    def digest(self) -> str:
        """sha256 (64 hex chars) over the canonical JSON of all fields. O(1)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"kvbackend-identity\0" + canonical.encode()).hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    files = [p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    if not files:
        raise ValueError(
            f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {model_dir}; "
            "a fingerprint of the config alone cannot tell checkpoints apart"
        )
    config = model_dir / CONFIG_FILE
    if config.is_file():
        files.append(config)
    return sorted(files, key=lambda p: p.name)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def default_memo_path() -> Path:
    base = os.environ.get("KVBACKEND_CACHE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvbackend"
    )
    return Path(base) / "fingerprints.json"


def _load_memo(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if data.get("version") == _MEMO_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    except (OSError, ValueError, AttributeError):
        pass
    return {}


def _save_memo(path: Path, files: dict) -> None:
    """Atomic replace; concurrent savers lose entries at worst (it is only a memo)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fingerprints.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _MEMO_VERSION, "files": files}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("kvbackend: cannot write fingerprint memo %s: %s", path, e)


def model_fingerprint(
    model_dir: str | os.PathLike, *, memo_path: str | os.PathLike | None = None,
    refresh: bool = False,
) -> str:
    """sha256 fingerprint of a model directory's weights and config.

    Covers every top-level ``*.safetensors``, ``*.bin``, ``*.pt`` file and
    ``config.json``: fingerprint = sha256 over ``name\\0size\\0sha256(content)\\n``
    per file, sorted by name. Independent of the directory's location.
    Raises ``ValueError`` if there is no weight file.

    Complexity: O(total bytes) on first call (streamed, 8 MiB chunks, O(1)
    memory); O(#files) stats afterwards while (real path, size, mtime_ns) match
    the memo at ``memo_path`` (default ``$KVBACKEND_CACHE_HOME/fingerprints.json``,
    else ``~/.cache/kvbackend/fingerprints.json``; ``False`` disables it).
    """
    model_dir = Path(model_dir)
    memo_file = None if memo_path is False else Path(memo_path or default_memo_path())
    memo = {} if memo_file is None else _load_memo(memo_file)
    changed = False
    outer = hashlib.sha256(b"kvbackend-model-fingerprint-v1\n")
    for path in _weight_files(model_dir):
        st = path.stat()  # follows symlinks (Hugging Face cache layout)
        memo_key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
        digest = None if refresh else memo.get(memo_key)
        if digest is None:
            digest = _file_sha256(path)
            stale = memo_key.rsplit("|", 2)[0] + "|"  # older stamps of the same file
            for k in [k for k in memo if k.startswith(stale)]:
                del memo[k]
            memo[memo_key] = digest
            changed = True
        outer.update(f"{path.name}\0{st.st_size}\0{digest}\n".encode())
    if changed and memo_file is not None:
        _save_memo(memo_file, memo)
    return outer.hexdigest()
