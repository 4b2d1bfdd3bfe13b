"""Topic-based publish/subscribe between the parts of a node and, through a transport,
between the nodes of a cluster. Local subscribers get every message published after
they subscribed, in order; messages from other nodes arrive as the transport delivers
them."""

import asyncio
import json
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol

from loguru import logger
from pydantic import TypeAdapter, ValidationError

from exo.shared.types.commands import Command
from exo.shared.types.common import NodeId
from exo.shared.types.election import Heartbeat
from exo.shared.types.events import Event, IndexedEvent
from exo.shared.types.state import StateDigest, StateSnapshot
from exo.shared.types.text_generation import ChunkGenerated


class Topic(StrEnum):
    COMMANDS = "commands"  # any node -> master
    LOCAL_EVENTS = "local_events"  # workers -> master, not yet ordered
    GLOBAL_EVENTS = "global_events"  # master -> every node, indexed (or a whole State)
    CHUNKS = "chunks"  # runner rank 0 -> the API that asked
    ELECTION = "election"  # heartbeats and candidacies


_ADAPTERS: dict[Topic, TypeAdapter[Any]] = {
    Topic.COMMANDS: TypeAdapter(Command),
    Topic.LOCAL_EVENTS: TypeAdapter(Event),
    Topic.GLOBAL_EVENTS: TypeAdapter(IndexedEvent | StateSnapshot | StateDigest),
    Topic.CHUNKS: TypeAdapter(ChunkGenerated),
    Topic.ELECTION: TypeAdapter(Heartbeat),
}


def adapter(topic: Topic) -> TypeAdapter[Any]:
    return _ADAPTERS[topic]


class Transport(Protocol):
    """Carries encoded messages to the other nodes of the cluster."""

    def start(self, on_message: Callable[[Topic, bytes], None]) -> None: ...

    def send(self, topic: Topic, payload: bytes) -> None: ...

    def close(self) -> None: ...


# At most one "unreadable" warning this often: a node of another cluster (one with a
# cluster secret, when this one has none) sends several a second.
UNREADABLE_WARN_SECONDS = 30.0

# Topics only the master reads: with no master elected yet, nobody would hear them.
TO_MASTER = (Topic.COMMANDS, Topic.LOCAL_EVENTS)


def _in_office(topic: Topic, message: Any, origin: NodeId) -> bool:
    """The message shows its sender acting as the master: an event it ordered, or a
    heartbeat naming itself (a node names itself only once its master listens)."""
    return topic is Topic.GLOBAL_EVENTS or (topic is Topic.ELECTION and message.master_id == origin)


class Router:
    def __init__(self, node_id: NodeId, transport: Transport | None = None) -> None:
        self.node_id = node_id
        self.transport = transport
        self._subscribers: dict[Topic, list[asyncio.Queue[Any]]] = {}
        self._origin_subscribers: dict[Topic, list[asyncio.Queue[tuple[NodeId, Any]]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Messages for the master, held until one is elected and heard from.
        self._held: list[tuple[Topic, Any]] | None = []
        self._awaited_master: NodeId | None = None
        self._on_master_heard: list[Callable[[], None]] = []
        self._unreadable_warned_at = -UNREADABLE_WARN_SECONDS

    def on_master_heard(self, listener: Callable[[], None]) -> None:
        """Called each time held messages are released to a newly elected master."""
        self._on_master_heard.append(listener)

    def master_elected(self, master_id: NodeId) -> None:
        """Hold messages for the master until `master_id` is heard on GLOBAL_EVENTS, or
        its heartbeat says it is the master: another node may learn of its election
        before that node has taken office, and what it sent in between would reach
        nobody. This node's own master listens from its start, so its messages go at once."""
        if self._held is None:
            self._held = []
        self._awaited_master = master_id
        if master_id == self.node_id:
            self._release_held()

    def _release_held(self) -> None:
        held, self._held, self._awaited_master = self._held or [], None, None
        for topic, message in held:
            self.publish(topic, message)
        for listener in self._on_master_heard:
            listener()

    def start(self) -> None:
        """Begin receiving from other nodes; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        if self.transport is not None:
            self.transport.start(self._on_remote)

    def subscribe(self, topic: Topic) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._subscribers.setdefault(topic, []).append(queue)
        return queue

    def subscribe_with_origin(self, topic: Topic) -> asyncio.Queue[tuple[NodeId, Any]]:
        """Like subscribe, each message with the node that published it."""
        queue: asyncio.Queue[tuple[NodeId, Any]] = asyncio.Queue()
        self._origin_subscribers.setdefault(topic, []).append(queue)
        return queue

    def unsubscribe(self, topic: Topic, queue: asyncio.Queue[Any]) -> None:
        subscribers = self._subscribers.get(topic, [])
        if queue in subscribers:
            subscribers.remove(queue)

    def publish(self, topic: Topic, message: Any) -> None:
        if self._held is not None and topic in TO_MASTER:
            self._held.append((topic, message))
            return
        self._deliver(topic, message, self.node_id)
        if self.transport is not None:
            body = adapter(topic).dump_json(message, by_alias=True)
            self.transport.send(topic, b'{"origin":' + json.dumps(self.node_id).encode() + b',"body":' + body + b"}")

    def _deliver(self, topic: Topic, message: Any, origin: NodeId) -> None:
        if origin == self._awaited_master and _in_office(topic, message, origin):
            self._release_held()
        for queue in self._subscribers.get(topic, []):
            queue.put_nowait(message)
        for origin_queue in self._origin_subscribers.get(topic, []):
            origin_queue.put_nowait((origin, message))

    def _on_remote(self, topic: Topic, payload: bytes) -> None:
        """Called on a transport thread."""
        try:
            envelope = json.loads(payload)
            if envelope["origin"] == self.node_id:
                return
            message = adapter(topic).validate_python(envelope["body"])
        except (ValueError, KeyError, ValidationError) as error:
            if time.monotonic() - self._unreadable_warned_at >= UNREADABLE_WARN_SECONDS:
                self._unreadable_warned_at = time.monotonic()
                logger.warning(
                    f"dropping unreadable {topic} message (another exo version, or a cluster secret?): {error}"
                )
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, topic, message, NodeId(envelope["origin"]))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
