"""The disk-tier keys of KVBackendConfig and what tier_transfer_config hands the connector."""

import os

import pytest

from kvbackend.store.checksum_key import KEY_ENV
from kvbackend.vllm import tier_transfer_config
from kvbackend.vllm.config import TIER_KEYS, KVBackendConfig

KEY = bytes(range(32))


def key_file(tmp_path, mode=0o600) -> str:
    path = tmp_path / "disk.key"
    path.write_bytes(KEY)
    os.chmod(path, mode)
    return str(path)


def test_a_zero_bound_with_a_directory_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="disk_cache_gb must be > 0 with a disk_cache_dir"):
        KVBackendConfig(disk_cache_dir=str(tmp_path), disk_cache_gb=0)
    assert KVBackendConfig(disk_cache_gb=0).disk_cache_dir is None  # no disk tier: fine


def test_key_file_is_checked_when_the_config_is_made(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    config = KVBackendConfig(disk_cache_dir=str(tmp_path), disk_cache_key_file=key_file(tmp_path))
    assert config.disk_checksum_key() == KEY
    with pytest.raises(ValueError, match="kvbackend: key file .* mode 0644"):
        KVBackendConfig(disk_cache_dir=str(tmp_path),
                        disk_cache_key_file=key_file(tmp_path, 0o644))
    with pytest.raises(ValueError, match="disk_cache_key_file needs disk_cache_dir"):
        KVBackendConfig(disk_cache_key_file=key_file(tmp_path))
    monkeypatch.setenv(KEY_ENV, "not hex")
    with pytest.raises(ValueError, match=f"kvbackend: {KEY_ENV}"):
        KVBackendConfig.from_json(f'{{"disk_cache_dir": "{tmp_path}"}}')
    assert KVBackendConfig().disk_cache_dir is None  # no disk tier: the variable is not read


@pytest.mark.parametrize("raw, match", [
    ({"disk_cache_shared_group": "yes"}, "disk_cache_shared_group must be true or false"),
    ({"disk_cache_key_file": ""}, "disk_cache_key_file must be a non-empty string"),
])
def test_bad_disk_keys(raw, match):
    with pytest.raises(ValueError, match=match):
        KVBackendConfig.from_dict(raw)


def test_tier_transfer_config_carries_every_tier_key(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    config = KVBackendConfig(host_cache_gb=1, disk_cache_dir=str(tmp_path), disk_cache_gb=2,
                             disk_cache_key_file=key_file(tmp_path), disk_cache_shared_group=True)
    extra = tier_transfer_config(config)["kv_connector_extra_config"]
    assert set(extra) == set(TIER_KEYS)
    again = KVBackendConfig.from_dict(extra)
    assert all(getattr(again, k) == getattr(config, k) for k in TIER_KEYS)
