"""This node's copy of State, kept by applying the master's indexed events in order."""

import asyncio
from collections.abc import Callable

from loguru import logger

from exo.routing.router import Router, Topic
from exo.shared.apply import apply
from exo.shared.types.commands import RequestEventLog
from exo.shared.types.events import IndexedEvent
from exo.shared.types.state import State


class StateReplica:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.state = State()
        self.history: list[IndexedEvent] = []
        self._events = router.subscribe(Topic.GLOBAL_EVENTS)
        self._early: dict[int, IndexedEvent] = {}
        self._gap_requested = False
        self._changed = asyncio.Condition()
        self._listeners: list[Callable[[State], None]] = []

    def on_change(self, listener: Callable[[State], None]) -> None:
        self._listeners.append(listener)

    async def run(self) -> None:
        while True:
            indexed: IndexedEvent = await self._events.get()
            self._receive(indexed)
            async with self._changed:
                self._changed.notify_all()
            for listener in self._listeners:
                listener(self.state)

    def _receive(self, indexed: IndexedEvent) -> None:
        if indexed.idx <= self.state.last_event_applied_idx:
            return
        self._early[indexed.idx] = indexed
        while (next_idx := self.state.last_event_applied_idx + 1) in self._early:
            event = self._early.pop(next_idx)
            self.state = apply(self.state, event)
            self.history.append(event)
        if self._early and not self._gap_requested:
            since = self.state.last_event_applied_idx + 1
            logger.debug(f"missing events from {since}; asking the master")
            self._gap_requested = True
            self.router.publish(Topic.COMMANDS, RequestEventLog(since_idx=since))
        elif not self._early:
            self._gap_requested = False

    async def wait_for(self, condition: Callable[[State], bool], timeout: float) -> State:
        """Wait until State satisfies condition; raises TimeoutError."""
        async with asyncio.timeout(timeout):
            async with self._changed:
                await self._changed.wait_for(lambda: condition(self.state))
        return self.state
