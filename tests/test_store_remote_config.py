"""The remote tier's configuration keys: checked when the config is made, never echoing a
password; they select the tier connector and reach it."""

import os

import pytest

from kvbackend.vllm import engine_kwargs
from kvbackend.vllm.config import KVBackendConfig


@pytest.mark.parametrize("url, message", [
    ("http://:s3cret@h:6379", "got a http:// URL"),
    ("h:6379", "must be redis://"),
    ("redis://:s3cret@h:99999", "not a valid URL"),
    (6379, "must be a string"),
])
def test_a_bad_url_is_refused_without_showing_it(url, message):
    with pytest.raises(ValueError, match=message) as error:
        KVBackendConfig(remote_cache_url=url)
    assert "s3cret" not in str(error.value)


def test_good_urls_select_the_tier_connector_and_reach_it(tmp_path):
    key_file = tmp_path / "remote.key"
    key_file.write_bytes(bytes(range(32)))
    os.chmod(key_file, 0o600)
    for url in ("redis://:pw@cache:6379/2", "rediss://u:p@cache/0?ssl_ca_certs=/ca.pem",
                "unix:///run/redis.sock"):
        kwargs = engine_kwargs(remote_cache_url=url, remote_cache_key_file=str(key_file))
        extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["remote_cache_url"] == url
        assert KVBackendConfig.from_dict(extra).remote_checksum_key() == bytes(range(32))


def test_a_key_file_needs_a_url_and_must_be_private(tmp_path):
    with pytest.raises(ValueError, match="remote_cache_key_file needs remote_cache_url"):
        KVBackendConfig(remote_cache_key_file=str(tmp_path / "k"))
    key_file = tmp_path / "remote.key"
    key_file.write_bytes(bytes(32))
    os.chmod(key_file, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        KVBackendConfig(remote_cache_url="redis://h", remote_cache_key_file=str(key_file))
