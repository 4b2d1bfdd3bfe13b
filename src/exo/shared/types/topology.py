"""Who can reach whom: the directed links between nodes, as the cluster has measured them."""

from exo.shared.types.common import FrozenModel, NodeId


class NetworkInterface(FrozenModel):
    name: str
    ip: str


class Connection(FrozenModel):
    """`source` reached `sink` at `sink_ip`. Links are directed: a firewall or a NAT can
    let one side in and not the other, and an MLX ring needs both ways."""

    source: NodeId
    sink: NodeId
    sink_ip: str
    latency_ms: float | None = None
    bandwidth_mbps: float | None = None


class Topology(FrozenModel):
    connections: list[Connection] = []

    def connection(self, source: NodeId, sink: NodeId) -> Connection | None:
        return next((c for c in self.connections if c.source == source and c.sink == sink), None)

    def has_edge(self, source: NodeId, sink: NodeId) -> bool:
        return self.connection(source, sink) is not None

    def neighbours(self, node_id: NodeId) -> list[NodeId]:
        """The nodes `node_id` has reached, in the order the links were first reported."""
        return [c.sink for c in self.connections if c.source == node_id]

    def with_connection(self, connection: Connection) -> "Topology":
        """This topology with the edge source -> sink inserted, or replaced in place."""
        key = (connection.source, connection.sink)
        if self.connection(*key) is None:
            return Topology(connections=[*self.connections, connection])
        return Topology(connections=[connection if (c.source, c.sink) == key else c for c in self.connections])

    def without_edge(self, source: NodeId, sink: NodeId) -> "Topology":
        return Topology(connections=[c for c in self.connections if (c.source, c.sink) != (source, sink)])

    def without_node(self, node_id: NodeId) -> "Topology":
        return Topology(connections=[c for c in self.connections if node_id not in (c.source, c.sink)])
