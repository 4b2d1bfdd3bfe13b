"""Topic-based publish/subscribe between the parts of a node (and, from the cluster
work on, between nodes over zenoh). Subscribers get every message published after they
subscribed, in order."""

import asyncio
from enum import StrEnum
from typing import Any


class Topic(StrEnum):
    COMMANDS = "commands"  # any node -> master
    LOCAL_EVENTS = "local_events"  # workers -> master, not yet ordered
    GLOBAL_EVENTS = "global_events"  # master -> every node, indexed
    CHUNKS = "chunks"  # runner rank 0 -> the API that asked
    ELECTION = "election"


class Router:
    def __init__(self) -> None:
        self._subscribers: dict[Topic, list[asyncio.Queue[Any]]] = {}

    def subscribe(self, topic: Topic) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._subscribers.setdefault(topic, []).append(queue)
        return queue

    def unsubscribe(self, topic: Topic, queue: asyncio.Queue[Any]) -> None:
        subscribers = self._subscribers.get(topic, [])
        if queue in subscribers:
            subscribers.remove(queue)

    def publish(self, topic: Topic, message: Any) -> None:
        for queue in self._subscribers.get(topic, []):
            queue.put_nowait(message)
