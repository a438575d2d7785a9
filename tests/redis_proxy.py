"""A relay in front of a test's Redis/Valkey server that pauses it mid-call (not a test module)."""

from __future__ import annotations

import socket
import threading

from kvbackend.testing.redis_server import RedisServer


class PausingProxy:
    """Relays TCP between clients and ``server``; the first time a client sends ``command``
    (e.g. ``b"GETRANGE"``: a load), pauses the server (SIGSTOP) just before relaying it.
    So the server stops exactly mid-load, after the lookups that found the blocks.
    ``paused`` is set then; resuming is the test's (``server.resume()``)."""

    def __init__(self, server: RedisServer, command: bytes) -> None:
        self.server, self.command = server, command.upper()
        self.paused = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

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

    def _relay(self, source: socket.socket, sink: socket.socket, watch: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if watch and not self.paused.is_set() and self.command in data.upper():
                    self.server.pause()
                    self.paused.set()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def __enter__(self) -> PausingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self._sockets:
            sock.close()
