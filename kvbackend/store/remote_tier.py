"""Remote tier: KV blocks in a Redis or Valkey server that a fleet of instances shares.

Keys and values
===============
One string per block::

    key    kvb:v2:<identity digest>:<block key>
    value  a block in the disk tier's format: 128-byte header + payload

``<identity digest>`` is ``CacheIdentity.digest()`` (model weights, KV dtype,
block size, KV layout, TP rank and size, format version, and the checksum key's
id for a keyed tier); the block key chains the identity, the namespace (salt,
LoRA) and every token of the prefix (:mod:`kvbackend.store.block_key`). The
header repeats identity and key and carries the token count, the payload
length and a BLAKE3 checksum over header and payload, keyed under the
checksum key if one is set (:mod:`kvbackend.store.block_file`, the disk tier's
own code). Every value read gets the disk tier's checks; one that fails any
(garbled, truncated or padded, another identity or key, unkeyed or under
another key on a keyed tier, not a string) is a miss and is deleted, so the
block is recomputed and written again. A client without the checksum key
cannot plant a block that a keyed tier accepts.

Size and retention are the server's
===================================
The tier never counts bytes: give the server ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (or ``allkeys-lfu``). An evicted block is a
miss. Under ``noeviction`` (the default) or a ``volatile-*`` policy (blocks
have no TTL) a full server refuses writes: puts fail, with one warning, and
back off, while reads go on. One value is a block plus 128 bytes, and Redis
adds about 100 bytes per key.

A slow or dead server
=====================
Every socket operation, connecting included, has ``timeout_s``, and nothing is
retried inside a call. A call that fails on the connection (refused, reset,
timed out: a server down, paused, restarting, unreachable) is a miss (``None``,
not stored, 0 present), logs one warning per outage and opens a circuit breaker
(:mod:`kvbackend.store.circuit_breaker`, ``backoff_s`` doubling up to
``max_backoff_s``). While it is open, every call returns a miss at once, without
touching the network, and no call is ever let through to probe the server: a
thread of the tier's own (:mod:`kvbackend.store.health_probe`) sends a PING
after each delay, and only its success closes the breaker (logged), so a server
that comes back is used again without a restart. The scheduler calls
``contains_many`` inside vLLM's step (SGLang's too): a server that stops
answering costs it at most one timeout per outage, in the call that finds it
out, never one per probe. A write refused by a server that answers (out of
memory, read-only replica, no permission) fails the puts of that call and backs
writes off the same way, except that there the next put after the delay is the
probe (puts run on the workers' writer threads, never in the step); reads go on.
No call raises for any of this: only the caller's errors (a malformed key, a
payload of the wrong size) raise.

Thread-safe (redis-py's connection pool; each call takes one connection).
Redis Cluster is not supported (a single server, a replica set behind one
address, or a proxy). Complexity: each batched call is one pipelined round
trip, plus one more only to delete values that failed a check; reads verify
at BLAKE3 speed (~4 GB/s per core).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvbackend.store.block_file import (
    FORMAT_VERSION, HEADER_LEN, CorruptBlock, as_byte_view, encode_header, verify_buffer,
)
from kvbackend.store.checksum_key import keyed_identity, read_private_file
from kvbackend.store.circuit_breaker import CircuitBreaker
from kvbackend.store.health_probe import HealthProbe
from kvbackend.store.identity import CacheIdentity
from kvbackend.store.tier import Payload, check_key, check_payload_sizes

logger = logging.getLogger("kvbackend.store")

__all__ = ["RemoteTier", "read_password_file", "redacted_url"]

MAX_VALUE_BYTES = 512 << 20  # Redis' default proto-max-bulk-len
_MAX_PAYLOAD = MAX_VALUE_BYTES - HEADER_LEN
_CONNECTION_ERRORS = (redis.RedisError, OSError)


def redacted_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def read_password_file(path: str) -> str:
    """The server's password from ``path``: a private file (mode 0600 or 0400, see
    ``read_private_file``), UTF-8, one trailing newline ignored. ``ValueError`` (naming
    the file, never its content) for a missing, shared, empty or undecodable one."""
    try:
        password = read_private_file(path, "password file").decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"password file {path} is not UTF-8: cannot decode byte "
                         f"{e.start}") from None
    password = password.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"password file {path} is empty")
    return password


class RemoteTier:
    """KV blocks of one ``identity`` in the Redis or Valkey server at ``url``.

    ``url``: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for
    TLS, or ``unix:///path/to/socket``; nothing connects until the first call.
    ``payload_sizes``: the sizes a block's payload of this identity may have (puts
    of another size raise; values holding another are misses); without them a
    value may be as large as the server takes (``MAX_VALUE_BYTES``). ``password``:
    the server's, when the URL holds none. ``close()`` when done: it also ends the
    health checks of an outage.
    """

    def __init__(
        self,
        url: str,
        identity: CacheIdentity,
        *,
        checksum_key: bytes | None = None,
        payload_sizes: Collection[int] | None = None,
        password: str | None = None,
        timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not isinstance(url, str):
            raise ValueError(f"remote cache url must be a string, got {type(url).__name__}")
        payload_sizes = check_payload_sizes(payload_sizes)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        identity = keyed_identity(identity, checksum_key)
        self.url = redacted_url(url)
        self.identity = identity
        self.identity_digest = identity.digest()
        self.prefix = f"kvb:v{FORMAT_VERSION}:{self.identity_digest}:"
        self.checksum_key = checksum_key
        self.payload_sizes = payload_sizes
        self.max_payload = max(payload_sizes) if payload_sizes else _MAX_PAYLOAD
        self._server = CircuitBreaker(backoff_s, max_backoff_s)
        self._health = HealthProbe(self._server, self._ping, self._back,
                                   "kvbackend-remote-health")
        self._writes = CircuitBreaker(backoff_s, max_backoff_s)
        self._client = self._connect(url, timeout_s, password)
        self._lock = threading.Lock()  # counters and warnings
        self._warned: set[str] = set()
        self._counters = dict(hits=0, misses=0, puts=0, put_failures=0, corrupt=0,
                              failures=0, skipped=0, probes=0, bytes_loaded=0,
                              bytes_stored=0)

    @staticmethod
    def _connect(url: str, timeout_s: float, password: str | None) -> redis.Redis:
        try:
            return redis.Redis.from_url(
                url, password=password, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0, protocol=2,
                driver_info=None)
        except ValueError as e:
            raise ValueError(f"bad remote cache url {redacted_url(url)}: {e}") from None

    def redis_key(self, key: str) -> str:
        """The server's key for block ``key``. O(1)."""
        return self.prefix + check_key(key)

    # -- batched calls: one round trip each --------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The verified payload of each key (a read-only view), or None for a miss."""
        names = [self.redis_key(k) for k in keys]
        if not names:
            return []
        limit = HEADER_LEN + self.max_payload  # GETRANGE's end is inclusive: one byte more
        replies = self._run(lambda pipe: [pipe.getrange(n, 0, limit) for n in names])
        if replies is None:
            self._count(misses=len(names))
            return [None] * len(names)
        payloads: list[memoryview | None] = []
        bad: list[str] = []
        for key, name, reply in zip(keys, names, replies):
            payload = self._verified(key, reply)
            if payload is None and reply:  # b"" is a missing key
                bad.append(name)
            payloads.append(payload)
        hits = [p for p in payloads if p is not None]
        self._count(hits=len(hits), misses=len(names) - len(hits), corrupt=len(bad),
                    bytes_loaded=sum(p.nbytes for p in hits))
        if bad:
            self._run(lambda pipe: [pipe.delete(n) for n in bad])
        return payloads

    def put_many(self, blocks: Iterable[tuple[str, Payload, int]]) -> int:
        """Store each (key, payload, num_tokens); returns how many the server took.
        Raises ``ValueError`` (before sending anything) for a bad key, token count or
        payload size."""
        values = [(self.redis_key(k), self._encode(k, p, n)) for k, p, n in blocks]
        if not values:
            return 0
        if not self._writes.allow():
            self._count(skipped=1, put_failures=len(values))
            return 0
        replies = self._run(lambda pipe: [pipe.set(n, v) for n, v in values])
        if replies is None:
            self._count(put_failures=len(values))
            return 0
        refused = [r for r in replies if isinstance(r, Exception)]
        if refused:
            self._fault(self._writes.failed(), self._writes, "writes refused", refused[0])
        elif self._writes.succeeded():
            logger.info("kvbackend: remote tier %s takes writes again", self.url)
        stored = len(values) - len(refused)
        self._count(puts=stored, put_failures=len(refused),
                    bytes_stored=sum(len(v) for (_, v), r in zip(values, replies)
                                     if not isinstance(r, Exception)))
        return stored

    def contains_many(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the server holds (0 when it cannot be asked)."""
        present = self.present_many(keys)
        return present.index(False) if False in present else len(present)

    def present_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the server holds each key (all False when it cannot be asked). A
        present value may still fail its check when read. Does not touch LRU order."""
        names = [self.redis_key(k) for k in keys]
        replies = self._run(lambda pipe: [pipe.exists(n) for n in names]) if names else None
        return [r == 1 for r in replies] if replies is not None else [False] * len(names)

    def remove_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys``; returns how many were present (0 when the server is away)."""
        names = [self.redis_key(k) for k in keys]
        replies = self._run(lambda pipe: [pipe.delete(n) for n in names]) if names else None
        return sum(r for r in replies or () if isinstance(r, int))

    # -- internals ------------------------------------------------------------------

    def _encode(self, key: str, payload: Payload, num_tokens: int) -> bytes:
        view = as_byte_view(payload)
        if self.payload_sizes and view.nbytes not in self.payload_sizes:
            raise ValueError(f"payload of {view.nbytes} bytes, but blocks of this tier "
                             f"hold {sorted(self.payload_sizes)}")
        if view.nbytes > _MAX_PAYLOAD:
            raise ValueError(f"payload of {view.nbytes} bytes, over {_MAX_PAYLOAD}")
        header = encode_header(self.identity_digest, key, num_tokens, view,
                               checksum_key=self.checksum_key)
        return b"".join((header, view))

    def _verified(self, key: str, reply: Any) -> memoryview | None:
        """The payload of a GETRANGE reply if it passes every check, else None."""
        if not reply:
            return None
        try:
            if isinstance(reply, Exception):  # WRONGTYPE: not a string
                raise CorruptBlock(str(reply))
            payload = verify_buffer(reply, self.identity_digest, key,
                                    checksum_key=self.checksum_key,
                                    max_payload=self.max_payload)[1]
            if self.payload_sizes and payload.nbytes not in self.payload_sizes:
                raise CorruptBlock(f"payload of {payload.nbytes} bytes, a block holds "
                                   f"{sorted(self.payload_sizes)}")
            return payload
        except CorruptBlock as e:
            self._warn_once("corrupt", "kvbackend: remote tier %s: dropping bad value %s%s: %s",
                            self.url, self.prefix, key, e)
            return None

    def _run(self, queue: Callable[[Any], Any]) -> list[Any] | None:
        """One pipelined round trip: ``queue(pipe)`` adds the commands. The replies (a
        failed command's reply is its exception), or None when the breaker is open (no
        network then) or the connection failed. Never raises for the server's state."""
        if not self._server.closed:
            self._count(skipped=1)
            return None
        try:
            with self._client.pipeline(transaction=False) as pipe:
                queue(pipe)
                replies = pipe.execute(raise_on_error=False)
        except _CONNECTION_ERRORS as e:
            self._fault(self._health.failed(), self._server, "server unavailable", e)
            self._count(failures=1)
            return None
        if self._server.succeeded():  # a call sent before another one failed
            self._back()
        return replies

    def _ping(self) -> bool:
        """The health check, on the probe thread: whether the server answers a PING."""
        self._count(probes=1)
        try:
            return bool(self._client.ping())
        except _CONNECTION_ERRORS as e:
            logger.debug("kvbackend: remote tier %s: health check failed (%s: %s)",
                         self.url, type(e).__name__, e)
            return False

    def _back(self) -> None:
        logger.info("kvbackend: remote tier %s is back", self.url)

    def _fault(self, began: bool, breaker: CircuitBreaker, what: str,
               error: BaseException) -> None:
        """``breaker`` was just opened: warn if this ``began`` an outage, else log at
        debug level."""
        (logger.warning if began else logger.debug)(
            "kvbackend: remote tier %s: %s (%s: %s); misses meanwhile, next try in %g s",
            self.url, what, type(error).__name__, error, breaker.delay_s)

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (logger.warning if first else logger.debug)(msg, *args)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
        return {**counters, "url": self.url, "identity": self.identity_digest,
                "server": "up" if self._server.closed else "backing off",
                "writes": "up" if self._writes.closed else "backing off"}

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming a broken invariant (both breakers', a health check
        running while the server's is open, counters >= 0)."""
        self._health.check_invariants()
        self._writes.check_invariants()
        with self._lock:
            if any(v < 0 for v in self._counters.values()):
                raise RuntimeError(f"negative counters {self._counters}")

    def close(self) -> None:
        """End the health checks and close the connections (a later call opens new ones
        and tries the server again)."""
        self._health.stop()
        self._client.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, identity={self.identity_digest[:12]}..)"
