"""A packet capture on loopback, in Python (no tcpdump here): every IPv4 TCP segment on
`lo` to or from the given ports, reassembled per connection and direction (loopback
shows each segment twice; a segment is kept once, by its sequence number). Needs CAP_NET_RAW (root in the test
container); `capture_unavailable_reason()` says why not when it cannot run."""

import contextlib
import socket
import struct
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator

ETH_P_ALL = 0x0003
ETH_HEADER = 14


def capture_unavailable_reason() -> str | None:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL)).close()
    except (OSError, AttributeError) as error:
        return f"no raw packet socket: {error}"
    return None


class LoopbackCapture:
    def __init__(self, ports: Iterable[int]) -> None:
        self.ports = set(ports)
        # (source port, destination port) -> sequence number -> payload
        self.flows: dict[tuple[int, int], dict[int, bytes]] = defaultdict(dict)
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        # A large receive buffer: on a busy loopback (a browser polling, a stream) the
        # kernel's default drops frames the reading thread has not taken yet.
        # SO_RCVBUFFORCE (33 on Linux, not in Python's socket module) passes the rmem_max cap.
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 32 << 20)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(1 << 17)
            except TimeoutError:
                continue
            self._take(frame)

    def _take(self, frame: bytes) -> None:
        ip = frame[ETH_HEADER:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
            return
        tcp = ip[(ip[0] & 0x0F) * 4 :]
        if len(tcp) < 20:
            return
        source, destination, sequence = struct.unpack_from(">HHI", tcp)
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if payload and {source, destination} & self.ports:
            self.flows[(source, destination)][sequence] = bytes(payload)

    def streams(self, ports: Iterable[int]) -> list[bytes]:
        """Each captured direction of each connection to or from `ports`, in order."""
        wanted = set(ports)
        return [
            b"".join(segments[sequence] for sequence in sorted(segments))
            for (source, destination), segments in list(self.flows.items())
            if {source, destination} & wanted
        ]


@contextlib.contextmanager
def loopback_capture(ports: Iterable[int]) -> Iterator[LoopbackCapture]:
    capture = LoopbackCapture(ports)
    capture._thread.start()
    try:
        yield capture
    finally:
        capture._stop.set()
        capture._thread.join()
        capture._sock.close()
