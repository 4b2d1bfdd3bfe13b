"""This node's copy of State and of the event history that builds it. Every node keeps
the history durably on disk, so any node elected master continues from it."""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from exo.routing.router import Router, Topic
from exo.shared.apply import apply
from exo.shared.event_log import EventLog
from exo.shared.types.commands import (
    AddCustomModelCard,
    CancelDownload,
    Command,
    DeleteCustomModelCard,
    DeleteDownload,
    RequestEventLog,
    StartDownload,
)
from exo.shared.types.common import NodeId
from exo.shared.types.events import CustomModelCardAdded, CustomModelCardDeleted, DownloadOrdered, IndexedEvent
from exo.shared.types.state import State

GAP_RETRY_SECONDS = 1.0


class StateReplica:
    def __init__(self, router: Router, log_path: Path, node_id: NodeId | None = None) -> None:
        self.router = router
        # Which of the dropped download orders this node asks for again (its own).
        self.node_id = node_id
        self.log = EventLog(log_path)
        self.state = State()
        for indexed in self.log.since(0):
            self.state = apply(self.state, indexed)
        self._events = router.subscribe_with_origin(Topic.GLOBAL_EVENTS)
        # The elected master (set by the node): after a partition heals, its history wins.
        self.master_id: NodeId | None = None
        self._early: dict[int, IndexedEvent] = {}
        self._gap_requested_at = -2
        self._gap_requested_time = 0.0
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[State], None]] = []

    @property
    def history(self) -> EventLog:
        """Every event this node applied, in order (read from its log on disk)."""
        return self.log

    def on_change(self, listener: Callable[[State], None]) -> None:
        self._listeners.append(listener)

    async def run(self) -> None:
        while True:
            try:
                origin, indexed = await asyncio.wait_for(self._events.get(), timeout=GAP_RETRY_SECONDS)
            except TimeoutError:
                self._request_missing()
                continue
            self.receive(indexed, origin)

    def receive(self, indexed: IndexedEvent, origin: NodeId | None = None) -> None:
        """Take an event from the master; events may arrive out of order or twice. One
        the elected master holds at an index where this node's history differs means the
        two wrote apart (each side of a partition elected its own master): this node
        drops its history from there and takes the master's. Once a master is elected,
        events from any other node (a master that lost its election and has not yet
        heard so) are not taken."""
        if origin is not None and self.master_id is not None and origin != self.master_id:
            return
        if indexed.idx <= self.state.last_event_applied_idx:
            if origin is not None and origin == self.master_id and self.log[indexed.idx] != indexed:
                self._adopt_from(indexed)
            return
        self._early[indexed.idx] = indexed
        applied = False
        while (next_idx := self.state.last_event_applied_idx + 1) in self._early:
            self._accept(self._early.pop(next_idx))
            applied = True
        self._request_missing()
        if applied:
            self._notify()

    def _request_missing(self) -> None:
        """Ask the master to re-send what is missing; again if the answer did not come."""
        if not self._early:
            return
        now = time.monotonic()
        if (
            self._gap_requested_at == self.state.last_event_applied_idx
            and now - self._gap_requested_time < GAP_RETRY_SECONDS
        ):
            return
        # One event back, so a history that went apart is seen in the overlap.
        since = max(self.state.last_event_applied_idx, 0)
        logger.debug(f"missing events from {since}; asking the master")
        self._gap_requested_at = self.state.last_event_applied_idx
        self._gap_requested_time = now
        self.router.publish(Topic.COMMANDS, RequestEventLog(since_idx=since))

    def _adopt_from(self, indexed: IndexedEvent) -> None:
        """Cut the history before `indexed`, take it, and ask the master for its whole
        log: an earlier difference shows in the replay and cuts again. What users asked
        for in the dropped part (cards, download orders) is asked for again, so a write
        accepted on the losing side of a partition is not lost."""
        dropped = list(self.log.since(indexed.idx))
        again = asked_again(dropped, self.node_id)
        logger.warning(
            f"event {indexed.idx} differs from the master's: dropping {len(dropped)} event(s) "
            f"this node applied apart from it and taking the master's history; asking again for {len(again)}"
        )
        state = State()
        for event in self.log.since(0, indexed.idx):
            state = apply(state, event)
        self.state = state
        self.log.truncate(indexed.idx)
        self._early = {i: e for i, e in self._early.items() if i > indexed.idx}
        self._accept(indexed)
        self._notify()
        self.router.publish(Topic.COMMANDS, RequestEventLog(since_idx=0))
        for command in again:
            self.router.publish(Topic.COMMANDS, command)

    def append(self, indexed: IndexedEvent) -> None:
        """The master's own path: durable on disk before anyone else hears of it."""
        self._accept(indexed)
        self._notify()

    def _accept(self, indexed: IndexedEvent) -> None:
        self.state = apply(self.state, indexed)
        self.log.append(indexed)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in self._listeners:
            listener(self.state)

    async def wait_for(self, condition: Callable[[State], bool], timeout: float) -> State:
        """Wait until State satisfies condition; raises TimeoutError."""
        async with asyncio.timeout(timeout):
            while not condition(self.state):
                await self._changed.wait()
        return self.state

    def close(self) -> None:
        self.log.close()


def asked_again(dropped: list[IndexedEvent], node_id: NodeId | None) -> list[Command]:
    """The commands behind the users' writes among `dropped` events. Every node of the
    losing side drops the same events: each asks again for the cards (the master adds an
    identical card once), and only the node a download order is for asks for that."""
    commands: list[Command] = []
    for indexed in dropped:
        match indexed.event:
            case CustomModelCardAdded(card=card):
                commands.append(AddCustomModelCard(card=card))
            case CustomModelCardDeleted(model_id=model_id):
                commands.append(DeleteCustomModelCard(model_id=model_id))
            case DownloadOrdered(node_id=order_node, model_id=model_id, order=order, layers=layers) if (
                order_node == node_id
            ):
                match order:
                    case "start":
                        commands.append(StartDownload(node_id=order_node, model_id=model_id, layers=layers))
                    case "cancel":
                        commands.append(CancelDownload(node_id=order_node, model_id=model_id))
                    case "delete":
                        commands.append(DeleteDownload(node_id=order_node, model_id=model_id))
            case _:
                pass
    return commands
