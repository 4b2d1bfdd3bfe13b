"""One exo node: election, master (when elected), worker, and the HTTP API, wired
together over the router."""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from loguru import logger

from exo.catalog.catalog import Catalog
from exo.master.master import Master
from exo.routing.chunk_streams import ChunkStreams
from exo.routing.election import Election
from exo.routing.replica import StateReplica
from exo.routing.router import Router, Topic, Transport
from exo.routing.seal import SealedTransport, peer_token, secret_fingerprint
from exo.routing.zenoh_transport import ZenohTransport
from exo.shared.history import History
from exo.shared.image_store import images_dir
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import Command
from exo.shared.types.common import CommandId, NodeId, new_id
from exo.shared.types.instances import EngineKind
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChunkGenerated
from exo.worker.supervisor import SpareRunner
from exo.worker.worker import Worker

if TYPE_CHECKING:
    from fastapi import FastAPI

    from exo.api.port import ApiSettings


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
    # --api-key: what every API request but the health check must carry; none: open.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # --cluster-secret: every message between nodes sealed with it (routing/seal.py).
    cluster_secret: str | None = field(default=None, repr=False)
    # --engine: what this node's runners run models with.
    engine: EngineKind = EngineKind.Mlx

    @property
    def peer_token(self) -> str | None:
        """What this node presents on the other nodes' peer endpoints (link probes, the
        peer file hub): the token derived from the cluster secret, else its own first
        API key (enough when the nodes share one)."""
        if self.cluster_secret:
            return peer_token(self.cluster_secret)
        return self.api_keys[0] if self.api_keys else None


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
    def __init__(self, config: NodeConfig, spare: SpareRunner | None = None) -> None:
        self.config = config
        self.node_id = load_node_id(config.exo_home)
        self.session_id = new_id()
        transport: Transport = ZenohTransport(
            config.namespace,
            config.listen_port,
            config.discovery_port,
            list(config.bootstrap_peers),
            config.multicast,
            config.discovery_interface,
        )
        if config.cluster_secret:
            transport = SealedTransport(transport, config.cluster_secret)
            logger.info(f"cluster messages sealed (secret fingerprint {secret_fingerprint(config.cluster_secret)})")
        self.router = Router(self.node_id, transport)
        data = config.exo_home / "data"
        self.replica = StateReplica(self.router, data / "history", self.node_id, legacy_log=data / "event_log.jsonl")
        self.catalog = Catalog(config.exo_home)
        self.chunk_streams = ChunkStreams(self.router)
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
                peer_token=config.peer_token,
                engine=config.engine,
                sealed=bool(config.cluster_secret),
                spare=spare,
            )
            if config.run_worker
            else None
        )
        if self.worker is not None:
            # Reports sent while the old master was dying may be lost; repeat them.
            self.router.on_master_heard(self.worker.report_runner_statuses)
        self.election = Election(self.node_id, self.session_id, self.router, self._on_elected, config.force_master)
        self._tasks: list[asyncio.Task[None]] = []

    # The API's port to the cluster (exo.api.port.ClusterPort).

    @property
    def settings(self) -> "ApiSettings":
        from exo.api.port import ApiSettings

        return ApiSettings(
            offline=self.config.offline,
            auto_place=self.config.auto_place,
            api_keys=self.config.api_keys,
            peer_token=self.config.peer_token,
            images_dir=images_dir(self.config.exo_home),
        )

    @property
    def state(self) -> State:
        return self.replica.state

    @property
    def history(self) -> History:
        return self.replica.history

    async def wait_for(self, condition: Callable[[State], bool], timeout: float) -> State:
        return await self.replica.wait_for(condition, timeout)

    def send_command(self, command: Command) -> None:
        self.election.commands_seen += 1
        self.router.publish(Topic.COMMANDS, command)

    def cards(self) -> dict[str, ModelCard]:
        """Built-in and local cards, and the custom ones the cluster was given."""
        return self.catalog.cards(self.replica.state.custom_model_cards)

    def local_model_ids(self) -> set[str]:
        return self.catalog.local_model_ids()

    def local_model_dir(self, model_id: str) -> Path | None:
        return self.catalog.local_model_dir(model_id)

    def model_dir_problem(self, model_id: str) -> str | None:
        return self.catalog.model_dir_problem(model_id)

    def open_chunks(self, command_id: CommandId) -> asyncio.Queue[ChunkGenerated]:
        return self.chunk_streams.open(command_id)

    def close_chunks(self, command_id: CommandId) -> None:
        self.chunk_streams.close(command_id)

    def chunks_open(self, command_id: CommandId) -> bool:
        return self.chunk_streams.is_open(command_id)

    def publish_chunk(self, chunk: ChunkGenerated) -> None:
        self.router.publish(Topic.CHUNKS, chunk)

    async def _on_elected(self, master_id: NodeId) -> None:
        self.replica.master_id = master_id
        if master_id == self.node_id and self.master is None:
            logger.info(f"node {self.node_id} is now the master")
            self.replica.start_term()
            self.master = Master(
                self.node_id, self.router, self.replica, self.election.alive_nodes, self.election.alive_sessions
            )
            self._master_task = asyncio.create_task(self.master.run(), name="master")
        elif master_id != self.node_id and self.master is not None:
            logger.info(f"node {self.node_id} steps down; {master_id} is the master")
            assert self._master_task is not None
            self._master_task.cancel()
            self.master = None
        self.router.master_elected(master_id)

    async def run(self) -> None:
        self.router.start()
        self._tasks.append(asyncio.create_task(self.replica.run(), name="replica"))
        self._tasks.append(asyncio.create_task(self.election.run(), name="election"))
        self._tasks.append(asyncio.create_task(self.catalog.watch(), name="catalog"))
        self._tasks.append(asyncio.create_task(self.chunk_streams.run(), name="chunk-streams"))
        if self.worker is not None:
            self._tasks.append(asyncio.create_task(self.worker.run(), name="worker"))
        # The API's modules (FastAPI, transformers' tokenizers: about half a second) load
        # in a thread while the loop runs: the worker starts its runners and the election
        # finds the master meanwhile, instead of after (a restarted node's time to serve).
        app = await asyncio.to_thread(_api_app, self)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
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
        from exo.api.placing import place_model

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


def _api_app(node: Node) -> "FastAPI":
    from exo.api.app import create_app

    return create_app(node)
