"""What every node announces about itself, for choosing the master."""

from exo.shared.types.common import FrozenModel, NodeId


class Heartbeat(FrozenModel):
    node_id: NodeId
    session_id: str  # new each time the node process starts
    started_at: float  # unix time the node started; earlier is more senior
    commands_seen: int
    force_master: bool = False
    # The master this node follows (itself when it is the master); None before its first round.
    master_id: NodeId | None = None
