"""The user-facing configuration of kvbackend inside vLLM.

The same keys arrive from ``--kv-backend-config JSON`` and from
``kvbackend.vllm.engine_kwargs(**config)``; they travel to the engine-core
process inside ``VllmConfig.additional_config["kvbackend"]``.

The plugin imports this module in every vLLM process, so it imports nothing of
kvbackend's store or core at module level: those load numba (llvmlite), and
llvmlite loaded before vLLM's worker rebinds its Triton kernels breaks the
worker's start-up (``_rebind_kernels`` walks ``sys.modules``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any
from urllib.parse import urlsplit

ADDITIONAL_CONFIG_KEY = "kvbackend"
# The keys the tier connector reads from ``kv_connector_extra_config``.
TIER_KEYS = ("host_cache_gb", "disk_cache_dir", "disk_cache_gb", "disk_cache_key_file",
             "disk_cache_shared_group", "remote_cache_url", "remote_cache_key_file",
             "remote_cache_password_file")
REMOTE_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class KVBackendConfig:
    """``max_pinned_fraction``: at most this share of the KV blocks may be pinned
    by ``kv_pin`` requests (the rest stays available, so pins cannot starve
    the engine). ``max_retained_fraction``: at most this share of the KV blocks
    may be retained by ``kv_retain_s`` requests (distinct blocks: a prefix several
    retentions share counts once); beyond it the oldest retention becomes ordinary first.

    Tiers below the device KV cache (served by ``kvbackend.vllm.tiers.connector``):
    ``host_cache_gb``: GiB of host memory per worker for evicted KV blocks (0: off);
    ``disk_cache_dir``: a directory for persistent, checksummed KV blocks, shared
    across restarts and processes (None: off); ``disk_cache_gb``: its size bound
    in GiB per model identity, split evenly across the TP ranks (> 0); with
    several processes on one directory the largest bound of a live one applies;
    ``disk_cache_key_file``: a 0600 file holding a 32-byte key for keyed BLAKE3
    checksums (else ``$KVBACKEND_DISK_KEY``, else unkeyed);
    ``disk_cache_shared_group``: share the directory within a group (2770/0660;
    default: private to this user, 0700/0600);
    ``remote_cache_url``: a Redis or Valkey server that a fleet of instances shares,
    below host and disk (``redis://[[user]:password@]host[:port][/db]``, ``rediss://``
    for TLS, ``unix://path``; None: off); ``remote_cache_password_file``: a 0600 file
    holding the server's password (``requirepass``, or the ACL user's named in the URL;
    one trailing newline ignored), as orchestrators mount secrets, instead of a password in
    the URL (both at once is an error); ``remote_cache_key_file``: a 0600 file
    holding a 32-byte key for keyed checksums of remote blocks (every instance of the
    fleet needs the same one; without it, unkeyed).

    ``explain_misses``: a file to which one JSON line per request is appended,
    saying how many prompt tokens were reused, from which tier, and why the rest
    were not (``kvbackend/vllm/miss_log.py``; None: off). Opened (created 0600)
    when the configuration is checked: a path that cannot be appended to is an error.
    """

    max_pinned_fraction: float = 0.5
    max_retained_fraction: float = 0.5
    host_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    disk_cache_key_file: str | None = None
    disk_cache_shared_group: bool = False
    remote_cache_url: str | None = None
    remote_cache_key_file: str | None = None
    remote_cache_password_file: str | None = None
    explain_misses: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_pinned_fraction", "max_retained_fraction"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value <= 1:
                raise ValueError(f"kvbackend: {name} must be a number in [0, 1], "
                                 f"got {value!r}")
        for name in ("host_cache_gb", "disk_cache_gb"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < float("inf"):
                raise ValueError(f"kvbackend: {name} must be a finite number >= 0, got {value!r}")
        for name in ("disk_cache_dir", "disk_cache_key_file", "remote_cache_key_file",
                     "remote_cache_password_file", "explain_misses"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"kvbackend: {name} must be a non-empty string (a path), "
                                 f"got {value!r}")
        if not isinstance(self.disk_cache_shared_group, bool):
            raise ValueError(f"kvbackend: disk_cache_shared_group must be true or false, "
                             f"got {self.disk_cache_shared_group!r}")
        self._check_remote()
        self._check_explain_misses()
        if self.disk_cache_dir is None:
            if self.disk_cache_key_file is not None:
                raise ValueError("kvbackend: disk_cache_key_file needs disk_cache_dir")
            return
        if self.disk_cache_gb == 0:
            raise ValueError("kvbackend: disk_cache_gb must be > 0 with a disk_cache_dir "
                             "(leave disk_cache_dir unset to turn the disk tier off)")
        self.disk_checksum_key()  # a bad key file or variable is an error now, not later

    def disk_checksum_key(self) -> bytes | None:
        """The disk tier's checksum key (``disk_cache_key_file``, else
        ``$KVBACKEND_DISK_KEY``), or None; ValueError for a bad one."""
        from kvbackend.store.checksum_key import load_checksum_key  # lazy: see module doc

        try:
            return load_checksum_key(self.disk_cache_key_file)
        except ValueError as e:
            raise ValueError(f"kvbackend: {e}") from None

    def _check_remote(self) -> None:
        url = self.remote_cache_url
        if url is None:
            for name in ("remote_cache_key_file", "remote_cache_password_file"):
                if getattr(self, name) is not None:
                    raise ValueError(f"kvbackend: {name} needs remote_cache_url")
            return
        if not isinstance(url, str):
            raise ValueError(f"kvbackend: remote_cache_url must be a string, got {url!r}")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as e:
            raise ValueError(f"kvbackend: remote_cache_url is not a valid URL: {e}") from None
        if parts.scheme not in REMOTE_SCHEMES or not (parts.hostname or parts.path):
            raise ValueError(f"kvbackend: remote_cache_url must be redis://host[:port][/db], "
                             f"rediss://... or unix://path, got a {parts.scheme or 'bare'}:// "
                             f"URL")  # never the URL itself: it may hold a password
        if self.remote_cache_password_file is not None and parts.password is not None:
            raise ValueError("kvbackend: remote_cache_url holds a password and "
                             "remote_cache_password_file is set; give one of them")
        self.remote_checksum_key()
        self.remote_password()

    def _check_explain_misses(self) -> None:
        if self.explain_misses is None:
            return
        try:
            os.close(open_for_append(self.explain_misses))
        except OSError as e:
            raise ValueError(f"kvbackend: explain_misses: cannot append to "
                             f"{self.explain_misses!r}: {e.strerror}") from None

    def remote_checksum_key(self) -> bytes | None:
        """The remote tier's checksum key (``remote_cache_key_file``), or None;
        ValueError for a bad one."""
        if self.remote_cache_key_file is None:
            return None
        from kvbackend.store.checksum_key import load_checksum_key  # lazy: see module doc

        try:
            return load_checksum_key(self.remote_cache_key_file)
        except ValueError as e:
            raise ValueError(f"kvbackend: {e}") from None

    def remote_password(self) -> str | None:
        """The remote server's password from ``remote_cache_password_file``, or None;
        ValueError for a file that is missing, readable by others, empty or not UTF-8."""
        path = self.remote_cache_password_file
        if path is not None:
            from kvbackend.store.remote_tier import read_password_file  # lazy: see module doc
            try:
                return read_password_file(path)
            except ValueError as e:
                raise ValueError(f"kvbackend: remote_cache_password_file: {e}") from None
        return None

    @property
    def tiers_enabled(self) -> bool:
        """Whether a host, disk or remote tier is configured (the tier connector is
        then used)."""
        return (self.host_cache_gb > 0 or self.disk_cache_dir is not None
                or self.remote_cache_url is not None)

    @classmethod
    def from_dict(cls, raw: Any) -> KVBackendConfig:
        """Validate a mapping of keys; unknown keys are an error, not ignored."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"kvbackend: the configuration must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kvbackend: unknown configuration key(s) {unknown}; "
                             f"known keys: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_json(cls, text: str) -> KVBackendConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kvbackend: --kv-backend-config is not valid JSON ({e}): "
                             f"{text!r}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_for_append(path: str) -> int:
    """An ``O_APPEND`` descriptor of ``path``, created 0600 if missing; OSError if not."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == value
