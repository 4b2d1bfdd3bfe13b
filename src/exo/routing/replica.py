"""This node's copy of State and of the event history that builds it. Every node keeps
the history durably on disk (`shared/history.py`: snapshots and the events after them),
so any node elected master continues from it."""

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from exo.routing.router import Router, Topic
from exo.shared.apply import apply
from exo.shared.history import History, must_be_durable
from exo.shared.types.commands import (
    AddCustomModelCard,
    CancelDownload,
    Command,
    DeleteCustomModelCard,
    DeleteDownload,
    RequestEventLog,
    StartDownload,
)
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.downloads import DownloadOrderEntry
from exo.shared.types.events import CustomModelCardAdded, CustomModelCardDeleted, DownloadOrdered, IndexedEvent
from exo.shared.types.state import State, StateDigest, StateSnapshot, state_digest

GAP_RETRY_SECONDS = 1.0
# A snapshot of State every this many events, or this often while events arrive: the
# log then holds at most about two intervals of events (3.5 MB at ~350 bytes an event),
# and a restart replays at most one (about 0.2 s).
SNAPSHOT_EVENTS = int(os.environ.get("EXO_SNAPSHOT_EVENTS", "5000"))
SNAPSHOT_SECONDS = float(os.environ.get("EXO_SNAPSHOT_SECONDS", "600"))


class StateReplica:
    def __init__(
        self, router: Router, history_dir: Path, node_id: NodeId | None = None, legacy_log: Path | None = None
    ) -> None:
        self.router = router
        # Which of the dropped download orders this node asks for again (its own).
        self.node_id = node_id
        self.log = History(history_dir, legacy_log)
        self.state = self._replay()
        self._events = router.subscribe_with_origin(Topic.GLOBAL_EVENTS)
        # The elected master (set by the node): after a partition heals, its history wins.
        self.master_id: NodeId | None = None
        self._early: dict[int, IndexedEvent] = {}
        self._gap_requested_at = -2
        self._gap_requested_time = 0.0
        # Set when this node's history went apart from the master's before anything it
        # still holds: it keeps serving its State until the master's snapshot replaces it.
        self._starting_over = False
        # The first event of this node's latest term as master (start_term): what it wrote
        # from there, the next master lacks if this node led the losing side of a partition.
        self._term_start: int | None = None
        self._snapshot_idx = max(self.log.snapshot_indices(), default=-1)
        self._snapshot_time = time.monotonic()
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[State], None]] = []

    def _replay(self) -> State:
        """State from the newest snapshot and the events after it. Events that do not
        follow on from the snapshot are dropped: the master re-sends them."""
        state = self.log.snapshot() or State()
        if self.log.start > state.last_event_applied_idx + 1:
            logger.warning(f"history holds events from {self.log.start}, not after the snapshot; asking the master")
            self.log.reset(state.last_event_applied_idx + 1)
            return state
        for indexed in self.log.since(state.last_event_applied_idx + 1):
            state = apply(state, indexed)
        return state

    @property
    def history(self) -> History:
        """The events this node applied since its oldest kept snapshot (read from disk)."""
        return self.log

    def head(self) -> IndexedEvent | None:
        """The newest event held (none right after taking the master's snapshot)."""
        return self.log[-1] if len(self.log) > self.log.start else None

    def on_change(self, listener: Callable[[State], None]) -> None:
        self._listeners.append(listener)

    async def run(self) -> None:
        while True:
            try:
                origin, indexed = await asyncio.wait_for(self._events.get(), timeout=GAP_RETRY_SECONDS)
            except TimeoutError:
                self._request_missing()
                self._maybe_snapshot()
                continue
            self.receive(indexed, origin)

    def receive(self, indexed: IndexedEvent | StateSnapshot | StateDigest, origin: NodeId | None = None) -> None:
        """Take an event from the master; events may arrive out of order or twice. One
        the elected master holds at an index where this node's history differs means the
        two wrote apart (each side of a partition elected its own master): this node
        drops its history from there and takes the master's. Once a master is elected,
        events from any other node (a master that lost its election and has not yet
        heard so) are not taken."""
        if origin is not None and self.master_id is not None and origin != self.master_id:
            return
        if isinstance(indexed, StateSnapshot):
            self._take_snapshot(indexed.snapshot)
            return
        if isinstance(indexed, StateDigest):
            # The master's own replica is ahead of what it published (it writes first).
            if origin != self.node_id:
                self._check_digest(indexed)
            return
        if self._starting_over:
            self._request_missing()  # the master's State is on its way; asked again if not
            return
        if indexed.idx <= self.state.last_event_applied_idx:
            if origin is None or origin != self.master_id:
                return
            if indexed.idx >= self.log.start and self.log[indexed.idx] != indexed:
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

    def _check_digest(self, digest: StateDigest) -> None:
        """The master's State, digested, as of its newest event (sent every second, after
        that event): a node holding a different State at that index, or events past it,
        wrote apart from the master where comparing events did not show it (each side
        wrote the same event at the indexes both still hold, or this node no longer
        holds the ones that differ)."""
        if self._starting_over or digest.idx > self.state.last_event_applied_idx:
            return  # behind: the events, or the master's State, are on their way
        if digest.idx < self.state.last_event_applied_idx:
            # Events past the master's newest (a dead master's last, which its successor
            # never got): dropped, if the State before them is the master's.
            state = self._state_before(digest.idx + 1)
            if state is not None and state_digest(state) == digest.digest:
                dropped = list(self.log.since(digest.idx + 1))
                logger.warning(f"dropping {len(dropped)} event(s) past the master's newest, {digest.idx}")
                self.state = state
                self.log.truncate(digest.idx + 1)
                self._snapshot_idx = max(self.log.snapshot_indices(), default=-1)
                self._early = {}
                self._notify()
                for command in asked_again(dropped, self.node_id):
                    self.router.publish(Topic.COMMANDS, command)
            else:
                self._start_over_from_master(f"this node's State at the master's newest event {digest.idx} differs")
        elif digest.digest != state_digest(self.state):
            self._start_over_from_master(f"this node's State at event {digest.idx} differs from the master's")

    def _state_before(self, idx: int) -> State | None:
        """This node's State before event `idx`, from a snapshot and the events after it;
        None when it no longer holds what that takes."""
        base = self.log.snapshot(before=idx)
        state = base or State()
        if state.last_event_applied_idx + 1 < self.log.start or idx < self.log.start:
            return None
        for event in self.log.since(state.last_event_applied_idx + 1, idx):
            state = apply(state, event)
        return state

    def _start_over_from_master(self, why: str) -> None:
        """This node's history went apart from the master's where it cannot cut it: ask
        for the master's State (since before any event) and take nothing else until it
        comes; the users' writes among the events it held are asked for again."""
        again = asked_again(list(self.log.since(self.log.start)), self.node_id)
        logger.warning(f"{why}: starting over from the master's State; asking again for {len(again)}")
        self._starting_over = True
        self._early = {}
        self._ask_since(-1)
        for command in again:
            self.router.publish(Topic.COMMANDS, command)

    def start_term(self) -> None:
        """This node is the master from its next event on."""
        self._term_start = self.state.last_event_applied_idx + 1

    def _take_snapshot(self, snapshot: State) -> None:
        """The master's State, sent because this node needed events the master no longer
        holds (or is starting over): taken if it is ahead of this node's. A node that was
        master since (the losing side of a partition, behind the winner) cannot compare
        histories: it asks again for the users' writes of its term, which the master adds
        once (an identical card, a download order, are no change)."""
        if snapshot.last_event_applied_idx < 0 or (
            not self._starting_over and snapshot.last_event_applied_idx <= self.state.last_event_applied_idx
        ):
            return
        logger.info(f"taking the master's snapshot at event {snapshot.last_event_applied_idx}")
        again: list[Command] = []
        if self._starting_over or (self._term_start is not None and self._term_start < self.log.start):
            # Users' writes whose events this node no longer held show in its State.
            again = asked_again_from_state(self.state, snapshot, self.node_id)
        elif self._term_start is not None:
            again = asked_again(list(self.log.since(self._term_start)), self.node_id)
        for command in again:
            self.router.publish(Topic.COMMANDS, command)
        self._start_over(snapshot)
        while (next_idx := self.state.last_event_applied_idx + 1) in self._early:
            self._accept(self._early.pop(next_idx))
        self._notify()

    def _start_over(self, state: State) -> None:
        self._starting_over = False
        self._term_start = None
        self.log.install_snapshot(state)
        self.state = state
        self._snapshot_idx = state.last_event_applied_idx
        self._early = {i: e for i, e in self._early.items() if i > state.last_event_applied_idx}

    def _maybe_snapshot(self) -> None:
        since = self.state.last_event_applied_idx - self._snapshot_idx
        if since >= SNAPSHOT_EVENTS or (since > 0 and time.monotonic() - self._snapshot_time >= SNAPSHOT_SECONDS):
            self.log.write_snapshot(self.state)
            self._snapshot_idx = self.state.last_event_applied_idx
            self._snapshot_time = time.monotonic()

    def _request_missing(self) -> None:
        """Ask the master to re-send what is missing; again if the answer did not come."""
        if self._starting_over:
            if time.monotonic() - self._gap_requested_time >= GAP_RETRY_SECONDS:
                self._ask_since(-1)
            return
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
        self._ask_since(since)

    def _ask_since(self, since: int) -> None:
        self._gap_requested_time = time.monotonic()
        self.router.publish(Topic.COMMANDS, RequestEventLog(since_idx=since))

    def _adopt_from(self, indexed: IndexedEvent) -> None:
        """Cut the history before `indexed`, take it, and ask the master for its log
        from the oldest event this node holds: an earlier difference shows in the replay
        and cuts again. What users asked for in the dropped part (cards, download
        orders) is asked for again, so a write accepted on the losing side of a
        partition is not lost. A difference at the oldest event held means the
        histories went apart before it: this node starts over from the master's
        snapshot, asking again for the users' writes among all it held and for those
        its State has and the master's lacks (`asked_again_from_state`)."""
        # Cut only where this node can rebuild the State just before the difference.
        state = self._state_before(indexed.idx) if indexed.idx > self.log.start else None
        if state is None:
            self._start_over_from_master(f"event {indexed.idx}, this node's oldest, differs from the master's")
            return
        dropped = list(self.log.since(indexed.idx))
        again = asked_again(dropped, self.node_id)
        logger.warning(
            f"event {indexed.idx} differs from the master's: dropping {len(dropped)} event(s) "
            f"this node applied apart from it and taking the master's history; asking again for {len(again)}"
        )
        self.state = state
        self.log.truncate(indexed.idx)
        self._term_start = None  # what it wrote before the difference, the master holds
        self._snapshot_idx = max(self.log.snapshot_indices(), default=-1)
        self._early = {i: e for i, e in self._early.items() if i > indexed.idx}
        self._accept(indexed)
        self._notify()
        self._ask_since(self.log.start)
        for command in again:
            self.router.publish(Topic.COMMANDS, command)

    def append(self, indexed: IndexedEvent) -> None:
        """The master's own path: on disk (fsynced unless it only describes a request,
        `must_be_durable`) before anyone else hears of it."""
        self._accept(indexed)
        self._notify()

    def _accept(self, indexed: IndexedEvent) -> None:
        self.state = apply(self.state, indexed)
        self.log.append(indexed, durable=must_be_durable(indexed.event))
        self._maybe_snapshot()

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
                commands.append(_download_command(order_node, model_id, DownloadOrderEntry(order=order, layers=layers)))
            case _:
                pass
    return commands


def asked_again_from_state(ours: State, masters: State, node_id: NodeId | None) -> list[Command]:
    """The users' writes this node's State holds and the master's does not, for a node
    whose history went apart before the oldest event it kept: its cards, and its own
    download orders. (A card deleted on this side is not known any more: it stays.)"""
    commands: list[Command] = [
        AddCustomModelCard(card=card)
        for model_id, card in ours.custom_model_cards.items()
        if masters.custom_model_cards.get(model_id) != card
    ]
    if node_id is not None:
        theirs = masters.download_orders.get(node_id, {})
        for model_id, entry in ours.download_orders.get(node_id, {}).items():
            if theirs.get(model_id) != entry:
                commands.append(_download_command(node_id, model_id, entry))
    return commands


def _download_command(node_id: NodeId, model_id: ModelId, entry: DownloadOrderEntry) -> Command:
    match entry.order:
        case "start":
            return StartDownload(node_id=node_id, model_id=model_id, layers=entry.layers)
        case "cancel":
            return CancelDownload(node_id=node_id, model_id=model_id)
        case "delete":
            return DeleteDownload(node_id=node_id, model_id=model_id)
