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


def password_file(tmp_path, text: bytes = b"s3cret\n", mode: int = 0o600) -> str:
    path = tmp_path / "redis.password"
    path.write_bytes(text)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("setup, message", [
    (lambda p: dict(remote_cache_password_file=str(p / "missing")), "cannot read password file"),
    (lambda p: dict(remote_cache_password_file=password_file(p, mode=0o644)), "chmod 600"),
    (lambda p: dict(remote_cache_password_file=password_file(p, b"\n")), "is empty"),
    (lambda p: dict(remote_cache_password_file=password_file(p, b"\xff\xfe")), "not UTF-8"),
    (lambda p: dict(remote_cache_password_file=password_file(p),
                    remote_cache_url="redis://:hunter2@h:6379"), "give one of them"),
])
def test_a_bad_password_file_is_refused_without_showing_a_password(tmp_path, setup, message):
    config = dict(remote_cache_url="redis://h:6379") | setup(tmp_path)
    with pytest.raises(ValueError, match=message) as error:
        KVBackendConfig(**config)
    assert "s3cret" not in str(error.value) and "hunter2" not in str(error.value)


def test_a_password_file_needs_a_url_and_reaches_the_connector(tmp_path):
    path = password_file(tmp_path, b"pa ss\n")
    with pytest.raises(ValueError, match="remote_cache_password_file needs remote_cache_url"):
        KVBackendConfig(remote_cache_password_file=path)
    kwargs = engine_kwargs(remote_cache_url="redis://u@h/0", remote_cache_password_file=path)
    extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert KVBackendConfig.from_dict(extra).remote_password() == "pa ss"
