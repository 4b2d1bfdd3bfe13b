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
from exo.shared.types.commands import RequestEventLog
from exo.shared.types.events import IndexedEvent
from exo.shared.types.state import State

GAP_RETRY_SECONDS = 1.0


class StateReplica:
    def __init__(self, router: Router, log_path: Path) -> None:
        self.router = router
        self.log = EventLog(log_path)
        self.history: list[IndexedEvent] = []
        self.state = State()
        for indexed in self.log.events:
            self.state = apply(self.state, indexed)
            self.history.append(indexed)
        self._events = router.subscribe(Topic.GLOBAL_EVENTS)
        self._early: dict[int, IndexedEvent] = {}
        self._gap_requested_at = -2
        self._gap_requested_time = 0.0
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[State], None]] = []

    def on_change(self, listener: Callable[[State], None]) -> None:
        self._listeners.append(listener)

    async def run(self) -> None:
        while True:
            try:
                indexed = await asyncio.wait_for(self._events.get(), timeout=GAP_RETRY_SECONDS)
            except TimeoutError:
                self._request_missing()
                continue
            self.receive(indexed)

    def receive(self, indexed: IndexedEvent) -> None:
        """Take an event from the master; events may arrive out of order or twice."""
        if indexed.idx <= self.state.last_event_applied_idx:
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
        since = self.state.last_event_applied_idx + 1
        logger.debug(f"missing events from {since}; asking the master")
        self._gap_requested_at = self.state.last_event_applied_idx
        self._gap_requested_time = now
        self.router.publish(Topic.COMMANDS, RequestEventLog(since_idx=since))

    def append(self, indexed: IndexedEvent) -> None:
        """The master's own path: durable on disk before anyone else hears of it."""
        self._accept(indexed)
        self._notify()

    def _accept(self, indexed: IndexedEvent) -> None:
        self.state = apply(self.state, indexed)
        self.log.append(indexed)
        self.history.append(indexed)

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
