"""What the API sees of the cluster: a narrow port the node implements. The API reads
State, waits for it to change, sends commands, reads model cards and listens to the
chunks of its own requests; it never reaches into the replica, the router or the
election. Routers get the port through FastAPI's `Depends` (see `ClusterDep`)."""

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Protocol

from fastapi import Depends, Request

from exo.shared.history import History
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import Command
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChunkGenerated


@dataclass(frozen=True)
class ApiSettings:
    # --offline: never reach the hub, so /models/add refuses.
    offline: bool = False
    # --auto-place / --no-auto-place; None: on only in a one-node cluster.
    auto_place: bool | None = None
    # How long a request whose instance went away before its first token waits for
    # another instance of the model (the master re-places a lost one) before a 503.
    reroute_seconds: float = 60.0
    # --api-key: every request but the health check carries one of these (api/auth.py).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # What the other nodes of the cluster present on the peer endpoints.
    peer_token: str | None = field(default=None, repr=False)
    # This node's image store (shared/image_store.py); None: images ride in the task.
    images_dir: Path | None = None


class ClusterPort(Protocol):
    @property
    def node_id(self) -> NodeId: ...

    @property
    def session_id(self) -> str:
        """This run of the node; chunks of this node's requests are addressed to it."""
        ...

    @property
    def settings(self) -> ApiSettings: ...

    @property
    def state(self) -> State:
        """This node's replica of State, as of the last event it applied."""
        ...

    @property
    def history(self) -> History: ...

    async def wait_for(self, condition: Callable[[State], bool], timeout: float) -> State:
        """Until State satisfies condition; raises TimeoutError."""
        ...

    def send_command(self, command: Command) -> None: ...

    def cards(self) -> Mapping[str, ModelCard]:
        """Built-in, local and custom cards: every model the cluster knows."""
        ...

    def local_model_ids(self) -> set[str]:
        """Models whose weights are in one of this node's models dirs."""
        ...

    def model_dir_problem(self, model_id: str) -> str | None:
        """Why a dir of this node's models dirs holding the model cannot be used (broken
        config.json, a truncated weight file), if one is and it was left out."""
        ...

    def local_model_dir(self, model_id: str) -> Path | None: ...

    def open_chunks(self, command_id: CommandId) -> asyncio.Queue[ChunkGenerated]:
        """The chunks of one command, from now on: open before sending the command."""
        ...

    def close_chunks(self, command_id: CommandId) -> None: ...

    def chunks_open(self, command_id: CommandId) -> bool: ...

    def publish_chunk(self, chunk: ChunkGenerated) -> None:
        """To every node's open streams of that command (how a cancel reaches them)."""
        ...


def cluster_port(request: Request) -> ClusterPort:
    return request.app.state.cluster


ClusterDep = Annotated[ClusterPort, Depends(cluster_port)]
