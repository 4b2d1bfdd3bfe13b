"""Whether this node can bind a rank's ring address before its runner tries: MLX's ring
backend fails the whole instance with "Couldn't bind socket (error: 98)" when another
program (or another cluster's ring) holds the port."""

import errno
import socket

from exo.shared.types.common import RunnerId
from exo.shared.types.instances import Instance


def own_ring_host(instance: Instance, runner_id: RunnerId) -> str | None:
    """The "ip:port" the rank of `runner_id` listens on; None for a single-node instance."""
    if len(instance.hosts) < 2:
        return None
    return instance.hosts[instance.shard_assignments.runner_to_shard[runner_id].device_rank]


def ring_port_taken(host: str) -> bool:
    """Binds `host` as MLX's ring does (SO_REUSEADDR, so a connection of an earlier ring
    lingering in TIME_WAIT does not count) and lets go at once. Only "in use" counts: an
    address this node does not have is the runner's to report."""
    ip, port = host.rsplit(":", 1)
    ip = ip.strip("[]")
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, int(port)))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False
