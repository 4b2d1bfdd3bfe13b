"""A handoff's KV between two runners on different nodes (engine/kv_handoff.py says what
moves): one TCP connection per request, from the decode runner to the prefill runner's
port. The decode side sends the handoff; where the prefill side's prefix cache lacks
some of the prefix the decode side holds, it says from where it wants it, and the
decode side sends those parts and a frame that ends them; the prefill side then answers
with the parts as each prefill chunk makes them, then one last frame saying how long its
prefill took (or why it failed).

With a cluster secret every frame is sealed as the MLX ring's broadcasts are: AES-256-GCM
with a key of its own derived from the secret (shared/cluster_secret.py). A frame's
associated data is the connection's random stream id and the frame's number, so a frame
cannot be read, forged, dropped, reordered or moved to another connection without the
receiver noticing; and the side that sealed it, so a frame cannot be reflected back to
its sender. Sockets are read and written on threads of their own; the runner's
stepping thread only queues and takes whole parts, and `notify` wakes it."""

import json
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from loguru import logger

from exo.engine.kv_handoff import HEADER_BYTES, Handoff, LayerPart, part_header
from exo.shared.cluster_secret import derive_key

_PURPOSE = b"exo kv handoff v1"
_NONCE_BYTES = 12
_STREAM_BYTES = 16
_LENGTH = struct.Struct("<Q")
# What a frame holds, its first byte once opened.
_REQUEST, _PART, _DONE, _ERROR, _WANT, _OFFERED = b"R", b"P", b"D", b"E", b"W", b"O"
# Who sealed a frame: the side asking for KV, or the side prefilling.
_DECODE_SIDE, _PREFILL_SIDE = b"d", b"p"
# A handoff request, at most (a prompt of tokens as JSON).
_MAX_REQUEST_BYTES = 64 << 20


class HandoffRefused(Exception):
    """A frame that does not authenticate, or a stream that broke off."""


class _Seal:
    """One side's seal of a connection: it seals as `side`, opens what the other sealed."""

    def __init__(self, secret: str | None, stream: bytes, side: bytes) -> None:
        self._aead = AESGCM(derive_key(secret, _PURPOSE)) if secret else None
        self._stream = stream
        self._side = side
        self._other = _PREFILL_SIDE if side == _DECODE_SIDE else _DECODE_SIDE
        self._sent = 0
        self._received = 0

    def seal(self, plaintext: bytes) -> bytes:
        aad = self._aad(self._side, self._sent)
        self._sent += 1
        if self._aead is None:
            return plaintext
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, aad)

    def open(self, body: bytes) -> bytes:
        aad = self._aad(self._other, self._received)
        self._received += 1
        if self._aead is None:
            return body
        try:
            return self._aead.decrypt(body[:_NONCE_BYTES], body[_NONCE_BYTES:], aad)
        except InvalidTag:
            raise HandoffRefused("a KV frame did not authenticate (another cluster secret?)") from None

    def _aad(self, side: bytes, index: int) -> bytes:
        return _PURPOSE + self._stream + side + _LENGTH.pack(index)


def _send(sock: socket.socket, body: bytes) -> int:
    sock.sendall(_LENGTH.pack(len(body)))
    sock.sendall(body)
    return _LENGTH.size + len(body)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise HandoffRefused("the KV stream broke off")
        got += n
    return bytes(data)


def _receive(sock: socket.socket, limit: int | None = None) -> bytes:
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if limit is not None and length > limit:
        raise HandoffRefused(f"a frame of {length} bytes")
    return _receive_exactly(sock, length)


def _part_of(plaintext: bytes) -> LayerPart:
    layer, start, end, whole, length = part_header(plaintext[:HEADER_BYTES])
    payload = plaintext[HEADER_BYTES : HEADER_BYTES + length]
    return LayerPart(layer, start, end, whole, payload)


# --- the prefill side ---------------------------------------------------------------------


class IncomingHandoff:
    """A decode runner's request: the runner may first `want` the decode side's prefix
    from a position (its parts then arrive in `offered`, then None), feeds `handoff` and
    calls `send` with each part, then `done` (or `fail`). A thread writes them out in
    order; another reads the connection, and when the decode side hangs up first (its
    request was cancelled) `abandoned` is set; each calls `notify`."""

    def __init__(self, sock: socket.socket, seal: _Seal, handoff: Handoff, notify: Callable[[], None]) -> None:
        self.handoff = handoff
        self.abandoned = threading.Event()
        self.offered: queue.Queue[LayerPart | None] = queue.Queue()
        self._sock = sock
        self._seal = seal
        self._notify = notify
        self._frames: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._write, daemon=True, name="kv-handoff-out").start()
        threading.Thread(target=self._read, daemon=True, name="kv-handoff-in").start()

    def want(self, start: int) -> None:
        self._frames.put(_WANT + json.dumps({"start": start}).encode())

    def send(self, part: LayerPart) -> None:
        self._frames.put(_PART + part.framed())

    def done(self, prefill_seconds: float) -> None:
        self._frames.put(_DONE + json.dumps({"prefill_seconds": prefill_seconds}).encode())
        self._frames.put(None)

    def fail(self, message: str) -> None:
        self._frames.put(_ERROR + message.encode())
        self._frames.put(None)

    def _write(self) -> None:
        try:
            while (frame := self._frames.get()) is not None:
                _send(self._sock, self._seal.seal(frame))
        except OSError as error:
            if not self.abandoned.is_set():
                logger.warning(f"KV handoff to a decode runner broke off: {error}")
        finally:
            _hang_up(self._sock)

    def _read(self) -> None:
        # After its request the decode side sends only what is wanted of it; the
        # connection's end comes next (or our own hang-up after the last frame: ignored).
        try:
            while True:
                frame = self._seal.open(_receive(self._sock))
                kind, rest = frame[:1], frame[1:]
                if kind == _PART:
                    self.offered.put(_part_of(rest))
                elif kind == _OFFERED:
                    self.offered.put(None)
                else:
                    raise HandoffRefused(f"an unknown frame {kind!r}")
                self._notify()
        except (OSError, HandoffRefused, ValueError):
            pass
        self.abandoned.set()
        self._notify()


class KvServer:
    """Listens for decode runners; their handoffs wait in `incoming` for the stepping
    thread (woken by `notify`)."""

    def __init__(self, host: str, port: int, secret: str | None, notify: Callable[[], None]) -> None:
        self._secret = secret
        self._notify = notify
        self.incoming: queue.Queue[IncomingHandoff] = queue.Queue()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="kv-handoff-server").start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._read_request, args=(sock,), daemon=True).start()

    def _read_request(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = _receive_exactly(sock, _STREAM_BYTES)
            seal = _Seal(self._secret, stream, _PREFILL_SIDE)
            request = seal.open(_receive(sock, _MAX_REQUEST_BYTES))
            if request[:1] != _REQUEST:
                raise HandoffRefused("not a handoff request")
            body = json.loads(request[1:])
            handoff = Handoff([int(t) for t in body["prompt"]], int(body["skip"]))
        except (HandoffRefused, OSError, ValueError, KeyError) as error:
            logger.warning(f"refused a KV handoff request: {error}")
            sock.close()
            return
        self.incoming.put(IncomingHandoff(sock, seal, handoff, self._notify))
        self._notify()

    def close(self) -> None:
        _hang_up(self._listener)


def _hang_up(sock: socket.socket) -> None:
    # shutdown first: on Linux, close alone leaves a thread blocked in accept or recv on
    # the socket for good.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# --- the decode side ----------------------------------------------------------------------


@dataclass(frozen=True)
class OfferWanted:
    """The prefill side lacks the decode side's prefix from `start` on: answer `offer`."""

    start: int


@dataclass(frozen=True)
class FetchEnd:
    """The last thing a fetch yields: the prefill side's own seconds, or why it failed."""

    prefill_seconds: float = 0.0
    error: str | None = None


class KvFetch:
    """A handoff asked of the prefill runner at `address`: a thread receives the parts
    into `items` (and an OfferWanted, if the prefill side lacks part of the prefix, which
    `offer` answers), then one FetchEnd; `wire_bytes` and `seconds` say what it took."""

    def __init__(
        self, address: tuple[str, int], handoff: Handoff, secret: str | None, notify: Callable[[], None]
    ) -> None:
        self.handoff = handoff
        self.items: queue.Queue[LayerPart | OfferWanted | FetchEnd] = queue.Queue()
        self.offered_tokens = 0
        self._offers: queue.Queue[list[LayerPart] | None] = queue.Queue()
        self.wire_bytes = 0
        self.started_at = time.perf_counter()
        self.seconds = 0.0
        self._notify = notify
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        threading.Thread(target=self._fetch, args=(address, secret), daemon=True, name="kv-handoff-fetch").start()

    def offer(self, parts: list[LayerPart]) -> None:
        """The parts an OfferWanted asked for, to send."""
        self._offers.put(parts)

    def close(self) -> None:
        """Hang up (the request was cancelled): the prefill side sees it and stops."""
        with self._lock:
            self._closed = True
            self._offers.put(None)
            if self._sock is not None:
                _hang_up(self._sock)

    def take(self) -> list[LayerPart | OfferWanted | FetchEnd]:
        taken: list[LayerPart | OfferWanted | FetchEnd] = []
        while True:
            try:
                taken.append(self.items.get_nowait())
            except queue.Empty:
                return taken

    def _fetch(self, address: tuple[str, int], secret: str | None) -> None:
        end = FetchEnd(error="the KV stream ended without a last frame")
        try:
            with socket.create_connection(address, timeout=30) as sock:
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    if self._closed:
                        return
                    self._sock = sock
                end = self._exchange(sock, secret)
        except (OSError, HandoffRefused, ValueError) as error:
            end = FetchEnd(error=f"{type(error).__name__}: {error}")
        self.seconds = time.perf_counter() - self.started_at
        self.items.put(end)
        self._notify()

    def _exchange(self, sock: socket.socket, secret: str | None) -> FetchEnd:
        stream = os.urandom(_STREAM_BYTES)
        seal = _Seal(secret, stream, _DECODE_SIDE)
        request = _REQUEST + json.dumps({"prompt": self.handoff.prompt, "skip": self.handoff.skip}).encode()
        sock.sendall(stream)
        self.wire_bytes += _STREAM_BYTES + _send(sock, seal.seal(request))
        while True:
            body = _receive(sock)
            self.wire_bytes += _LENGTH.size + len(body)
            frame = seal.open(body)
            kind, rest = frame[:1], frame[1:]
            if kind == _PART:
                self.items.put(_part_of(rest))
                self._notify()
            elif kind == _WANT:
                self._send_offer(sock, seal, int(json.loads(rest)["start"]))
            elif kind == _DONE:
                return FetchEnd(prefill_seconds=float(json.loads(rest)["prefill_seconds"]))
            elif kind == _ERROR:
                return FetchEnd(error=rest.decode(errors="replace"))
            else:
                raise HandoffRefused(f"an unknown frame {kind!r}")

    def _send_offer(self, sock: socket.socket, seal: _Seal, start: int) -> None:
        # The parts come from the runner's stepping thread, which owns the engine.
        self.items.put(OfferWanted(start))
        self._notify()
        parts = self._offers.get()
        if parts is None:
            raise HandoffRefused("the request was cancelled")
        for part in parts:
            self.wire_bytes += _send(sock, seal.seal(_PART + part.framed()))
        self.wire_bytes += _send(sock, seal.seal(_OFFERED))
        self.offered_tokens = self.handoff.skip - start
