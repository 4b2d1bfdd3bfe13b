"""Finding and measuring the links from this node to the others: which address reaches
each peer's API, with what latency and bandwidth. Results become topology events."""

import time

import httpx
import psutil

from exo.shared.types.common import NodeId
from exo.shared.types.nodes import NodeInfo
from exo.shared.types.topology import Connection, NetworkInterface

LATENCY_SAMPLES = 3
BANDWIDTH_PROBE_BYTES = 4 * 2**20
PROBE_TIMEOUT_SECONDS = 2.0


def local_interfaces() -> list[NetworkInterface]:
    return [
        NetworkInterface(name=name, ip=address.address)
        for name, addresses in psutil.net_if_addrs().items()
        for address in addresses
        if address.family.name == "AF_INET"
    ]


def candidate_ips(peer: NodeInfo, own_ips: set[str]) -> list[str]:
    """Where to try reaching a peer. A peer that shares an address with us is on this
    machine, and loopback reaches it without leaving the host."""
    peer_ips = [i.ip for i in peer.interfaces if not i.ip.startswith("127.")]
    if any(ip in own_ips for ip in peer_ips) or not peer_ips:
        return ["127.0.0.1"]
    return peer_ips


async def measure_link(client: httpx.AsyncClient, source: NodeId, peer: NodeInfo, ip: str) -> Connection | None:
    base = f"http://{ip}:{peer.api_port}"
    try:
        latencies = []
        for _ in range(LATENCY_SAMPLES):
            started = time.perf_counter()
            response = await client.get(f"{base}/node_id")
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200 or response.json() != peer.node_id:
                return None
        started = time.perf_counter()
        # Counted as it arrives, not held: this runs every few seconds for every peer.
        received = 0
        async with client.stream("GET", f"{base}/link_probe", params={"size": BANDWIDTH_PROBE_BYTES}) as response:
            async for chunk in response.aiter_raw():
                received += len(chunk)
        elapsed = time.perf_counter() - started
        if response.status_code != 200 or received != BANDWIDTH_PROBE_BYTES:
            return None
    except (httpx.HTTPError, ValueError):
        return None
    return Connection(
        source=source,
        sink=peer.node_id,
        sink_ip=ip,
        latency_ms=min(latencies) * 1000,
        bandwidth_mbps=BANDWIDTH_PROBE_BYTES * 8 / elapsed / 1e6,
    )


async def probe_peer(client: httpx.AsyncClient, source: NodeId, peer: NodeInfo, own_ips: set[str]) -> Connection | None:
    for ip in candidate_ips(peer, own_ips):
        connection = await measure_link(client, source, peer, ip)
        if connection is not None:
            return connection
    return None


def worth_reporting(old: Connection | None, new: Connection) -> bool:
    """Measurements wobble; only report a new link, a new address, or a big change."""
    if old is None or old.sink_ip != new.sink_ip:
        return True

    def moved(a: float | None, b: float | None, floor: float) -> bool:
        if a is None or b is None:
            return a != b
        return abs(a - b) > max(floor, 0.5 * max(a, b))

    return moved(old.latency_ms, new.latency_ms, 1.0) or moved(old.bandwidth_mbps, new.bandwidth_mbps, 10.0)
