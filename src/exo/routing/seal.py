"""The cluster secret: every message between nodes sealed with a key derived from it.

A sealed message is `MAGIC | nonce | AES-256-GCM(key, nonce, sent_at_ms | payload,
aad=topic)`. GCM's tag authenticates it (a node without the secret can neither read nor
forge one, and a message cannot be moved to another topic); the send time inside the
authenticated part, checked against this node's clock, and a record of every nonce seen
within that window reject a replayed message. Node clocks must agree within
`MAX_AGE_SECONDS`.

Nodes also call each other's HTTP API (link probes, the peer file hub); `peer_token` is
the bearer token they send there, derived from the same secret (so the secret itself
never travels)."""

import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from hashlib import sha256

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from loguru import logger

from exo.routing.router import Topic, Transport
from exo.shared.cluster_secret import derive_key

MAGIC = b"exo\x01"
NONCE_BYTES = 12
# How far a message's send time may be from this node's clock, either way.
MAX_AGE_SECONDS = 60.0
# At most one warning per reason this often, however many messages are dropped.
WARN_EVERY_SECONDS = 30.0
_SENT_AT = struct.Struct(">Q")


class Rejected(Exception):
    """A message that is not from a node holding this cluster's secret, or is a replay."""


def peer_token(secret: str) -> str:
    """The bearer token nodes of a cluster present on each other's peer endpoints."""
    return derive_key(secret, b"exo peer http v1").hex()


def secret_fingerprint(secret: str) -> str:
    """A short name for a secret that can be logged: nodes that print different ones
    were given different secrets."""
    return sha256(derive_key(secret, b"exo fingerprint v1")).hexdigest()[:8]


class Seal:
    def __init__(self, secret: str, clock: Callable[[], float] = time.time) -> None:
        self._aead = AESGCM(derive_key(secret, b"exo routing v1"))
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._seen_order: deque[tuple[float, bytes]] = deque()

    def seal(self, topic: Topic, payload: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        sent_at = _SENT_AT.pack(int(self._clock() * 1000))
        return MAGIC + nonce + self._aead.encrypt(nonce, sent_at + payload, topic.value.encode())

    def open(self, topic: Topic, sealed: bytes) -> bytes:
        """The payload of a sealed message; raises Rejected for anything else."""
        if not sealed.startswith(MAGIC):
            raise Rejected("not sealed (a node without a cluster secret?)")
        nonce = sealed[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        try:
            plain = self._aead.decrypt(nonce, sealed[len(MAGIC) + NONCE_BYTES :], topic.value.encode())
        except (InvalidTag, ValueError) as error:
            raise Rejected("does not authenticate (a node with another cluster secret?)") from error
        now = self._clock()
        (sent_at_ms,) = _SENT_AT.unpack_from(plain)
        if abs(now - sent_at_ms / 1000) > MAX_AGE_SECONDS:
            raise Rejected(f"sent {now - sent_at_ms / 1000:+.0f} s from this node's clock (a replay, or clock skew?)")
        with self._lock:
            self._forget_older_than(now - 2 * MAX_AGE_SECONDS)
            if nonce in self._seen:
                raise Rejected("already received (a replay)")
            self._seen.add(nonce)
            self._seen_order.append((now, nonce))
        return plain[_SENT_AT.size :]

    def _forget_older_than(self, cutoff: float) -> None:
        # A nonce older than the window cannot come back: its send time fails the check.
        while self._seen_order and self._seen_order[0][0] < cutoff:
            self._seen.discard(self._seen_order.popleft()[1])


class SealedTransport:
    """A transport whose every message is sealed with the cluster secret; what does not
    open is dropped before the router sees it."""

    def __init__(self, inner: Transport, secret: str) -> None:
        self.inner = inner
        self.seal = Seal(secret)
        self._warned_at: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def start(self, on_message: Callable[[Topic, bytes], None]) -> None:
        def opened(topic: Topic, sealed: bytes) -> None:
            try:
                payload = self.seal.open(topic, sealed)
            except Rejected as error:
                self._warn(topic, str(error))
                return
            on_message(topic, payload)

        self.inner.start(opened)

    def send(self, topic: Topic, payload: bytes) -> None:
        self.inner.send(topic, self.seal.seal(topic, payload))

    def close(self) -> None:
        self.inner.close()

    def _warn(self, topic: Topic, reason: str) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._warned_at.get(reason, -WARN_EVERY_SECONDS) >= WARN_EVERY_SECONDS:
            self._warned_at[reason] = now
            logger.warning(f"dropping {topic} message: {reason}; {self._dropped[reason]} dropped so far")
