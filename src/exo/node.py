"""One exo node: election, master (when elected), worker, and the HTTP API, wired
together over the router."""

import asyncio
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from loguru import logger

from exo.master.master import Master
from exo.routing.election import Election
from exo.routing.replica import StateReplica
from exo.routing.router import Router, Topic
from exo.routing.zenoh_transport import ZenohTransport
from exo.shared.models.model_cards import ModelCard, all_cards
from exo.shared.types.commands import Command
from exo.shared.types.common import NodeId, new_id
from exo.worker.worker import Worker


@dataclass(frozen=True)
class NodeConfig:
    exo_home: Path
    api_port: int = 52415
    api_host: str = "0.0.0.0"
    listen_port: int = 0
    discovery_port: int = 0
    bootstrap_peers: tuple[str, ...] = ()
    namespace: str = "exo"
    multicast: bool = True
    discovery_interface: str = "auto"
    offline: bool = False
    run_worker: bool = True
    force_master: bool = False
    verbose: bool = False
    place_model: str | None = None
    # Place a requested model that has no instance and wait for it; None: only when the
    # cluster has exactly one node.
    auto_place: bool | None = None


def load_node_id(exo_home: Path) -> NodeId:
    """A node keeps its id across restarts."""
    path = exo_home / "config" / "node_id"
    if path.exists():
        return NodeId(path.read_text().strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    node_id = NodeId(new_id())
    path.write_text(node_id)
    return node_id


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = load_node_id(config.exo_home)
        self.session_id = new_id()
        transport = ZenohTransport(
            config.namespace,
            config.listen_port,
            config.discovery_port,
            list(config.bootstrap_peers),
            config.multicast,
            config.discovery_interface,
        )
        self.router = Router(self.node_id, transport)
        self.replica = StateReplica(self.router, config.exo_home / "data" / "event_log.jsonl")
        self.master: Master | None = None
        self._master_task: asyncio.Task[None] | None = None
        self.worker = (
            Worker(
                self.node_id,
                self.router,
                self.replica,
                config.exo_home,
                config.api_port,
                config.verbose,
                offline=config.offline,
            )
            if config.run_worker
            else None
        )
        self.election = Election(self.node_id, self.session_id, self.router, self._on_elected, config.force_master)
        self._tasks: list[asyncio.Task[None]] = []

    def cards(self) -> dict[str, ModelCard]:
        """Built-in and local cards, and the custom ones the cluster was given."""
        return {**all_cards(self.config.exo_home), **self.replica.state.custom_model_cards}

    def send_command(self, command: Command) -> None:
        self.election.commands_seen += 1
        self.router.publish(Topic.COMMANDS, command)

    async def _on_elected(self, master_id: NodeId) -> None:
        if master_id == self.node_id and self.master is None:
            logger.info(f"node {self.node_id} is now the master")
            self.master = Master(
                self.node_id, self.router, self.replica, self.election.alive_nodes, self.election.alive_sessions
            )
            self._master_task = asyncio.create_task(self.master.run(), name="master")
        elif master_id != self.node_id and self.master is not None:
            logger.info(f"node {self.node_id} steps down; {master_id} is the master")
            assert self._master_task is not None
            self._master_task.cancel()
            self.master = None
        self.router.master_elected()
        if self.worker is not None:
            # Reports sent while the old master was dying may be lost; repeat them.
            self.worker.report_runner_statuses()

    async def run(self) -> None:
        from exo.api.app import create_app

        self.router.start()
        self._tasks.append(asyncio.create_task(self.replica.run(), name="replica"))
        self._tasks.append(asyncio.create_task(self.election.run(), name="election"))
        if self.worker is not None:
            self._tasks.append(asyncio.create_task(self.worker.run(), name="worker"))
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(self),
                host=self.config.api_host,
                port=self.config.api_port,
                log_level="warning",
                timeout_graceful_shutdown=2,
            )
        )
        if self.config.place_model:
            self._tasks.append(asyncio.create_task(self._place_on_start(self.config.place_model)))
        print(
            f"exo node {self.node_id} serving http://localhost:{self.config.api_port} (dashboard and API)", flush=True
        )
        try:
            await server.serve()
        finally:
            await self.close()

    async def _place_on_start(self, model_id: str) -> None:
        from exo.api.routers.cluster import place_model

        await self.replica.wait_for(lambda s: self.node_id in s.nodes, timeout=60)
        if any(i.model_id == model_id for i in self.replica.state.instances.values()):
            return
        place_model(self, model_id)
        logger.info(f"placing {model_id}")

    async def close(self) -> None:
        if self.worker is not None:
            await self.worker.close()
        for task in [*self._tasks, self._master_task]:
            if task is not None:
                task.cancel()
        self.router.close()
        self.replica.close()
