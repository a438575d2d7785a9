"""Free local TCP ports for the servers tests and benchmarks start (vLLM, Redis, NIXL's
side channel)."""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # below: well-known and commonly configured service ports


def free_port() -> int:
    """A TCP port nothing is bound to now, drawn at random below the kernel's ephemeral
    range. A server binds it later (vLLM's NIXL side channel, after loading the model):
    a port from the ephemeral range could by then be some process's outgoing connection
    (a CI run's NIXL listener died on "Address already in use" and its request hung),
    and the kernel never hands out ports below it. O(1) tries, typically one."""
    high = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{LOWEST}, {high})")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
