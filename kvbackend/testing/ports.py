"""Free local TCP ports for the servers tests and benchmarks start (vLLM, Redis, NIXL's
side channel)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on now on 127.0.0.1 (another process may take it
    before the caller binds it; the servers started here bind it at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
