"""A relay in front of a test's Redis/Valkey server that counts commands and simulates outages
(not a test module)."""

from __future__ import annotations

import re
import socket
import threading
from collections import Counter

from kvbackend.testing.redis_server import RedisServer

_COMMAND = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n")  # a RESP array's first bulk string


class RedisProxy:
    """Relays TCP between clients and ``server``, counting the commands clients send.

    ``pause_on`` (e.g. ``b"GETRANGE"``: a load): the first time a client sends it, the
    server is paused (SIGSTOP) just before it is relayed, so it stops exactly mid-load,
    after the lookups that found the blocks; ``paused`` is set then, resuming is the
    test's (``server.resume()``). ``freeze()``: from then on nothing is relayed either
    way (a server that stopped answering, connections still open) until ``thaw()``;
    commands sent meanwhile are still counted (``count``)."""

    def __init__(self, server: RedisServer, pause_on: bytes | None = None) -> None:
        self.server = server
        self.pause_on = pause_on.upper() if pause_on is not None else None
        self.paused = threading.Event()
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        self._commands: Counter[bytes] = Counter()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def count(self, command: bytes) -> int:
        """How many ``command`` (e.g. ``b"PING"``) clients have sent so far."""
        with self._lock:
            return self._commands[command.upper()]

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.server.port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, False),
                             daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if from_client:
                    self._watch(data)
                if not self._frozen.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def _watch(self, data: bytes) -> None:
        with self._lock:
            self._commands.update(name.upper() for name in _COMMAND.findall(data))
        if (self.pause_on is not None and not self.paused.is_set()
                and self.pause_on in data.upper()):
            self.server.pause()
            self.paused.set()

    def __enter__(self) -> RedisProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self._sockets:
            sock.close()
