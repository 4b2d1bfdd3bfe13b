"""Choosing the master. Every node sends heartbeats carrying its candidacy; on any change
in who is alive, after a short debounce, each node picks the best live candidate by
(force_master, seniority, commands seen, node id).

Seniority is the wall-clock time a node started, so it reads the same on every node and
never changes: nodes with the same view of who is alive always pick the same master, and
the oldest node keeps the job as others come and go. (A round counter or an uptime read
at slightly different moments on each node could make two nodes each pick themselves.)

A node joining a cluster that already has a master need not wait out the debounce: a
heartbeat from a node that says it is the master, and that wins among every candidate
heard so far, is followed at once (`master_to_follow`). Being the youngest, a restarted
node never wins against it, so the round after the debounce names the same master; if
it names another (a more senior node heard later), that round's answer stands."""

import asyncio
import time
from collections.abc import Awaitable, Callable

from loguru import logger

from exo.routing.router import Router, Topic
from exo.shared.types.common import NodeId
from exo.shared.types.election import Heartbeat

HEARTBEAT_SECONDS = 0.5
# A node silent this long has left.
PEER_TIMEOUT_SECONDS = 3.0
# Wait this long after a membership change before deciding, so a burst of joins or a
# node's first moments (when it has not yet heard its peers) produce one decision.
DEBOUNCE_SECONDS = 1.5


def election_key(candidate: Heartbeat) -> tuple[bool, float, int, str]:
    return (candidate.force_master, -candidate.started_at, candidate.commands_seen, candidate.node_id)


def choose_master(candidates: list[Heartbeat]) -> NodeId:
    return max(candidates, key=election_key).node_id


def master_to_follow(own: Heartbeat, heard: Heartbeat, peers: list[Heartbeat]) -> NodeId | None:
    """The master to follow before this node's first round: `heard`'s sender when it says
    it is the master and it wins among this node and every peer heard (`peers`)."""
    if heard.master_id != heard.node_id:
        return None
    return heard.node_id if choose_master([own, heard, *peers]) == heard.node_id else None


class Election:
    def __init__(
        self,
        node_id: NodeId,
        session_id: str,
        router: Router,
        on_elected: Callable[[NodeId], Awaitable[None]],
        force_master: bool = False,
    ) -> None:
        self.node_id = node_id
        self.session_id = session_id
        self.router = router
        self.on_elected = on_elected
        self.force_master = force_master
        self.clock = 0
        self.commands_seen = 0
        self.master_id: NodeId | None = None
        self.started_at = time.time()
        self._peers: dict[NodeId, tuple[Heartbeat, float]] = {}
        self._heartbeats = router.subscribe(Topic.ELECTION)
        self._membership_changed = asyncio.Event()

    def candidacy(self) -> Heartbeat:
        return Heartbeat(
            node_id=self.node_id,
            session_id=self.session_id,
            started_at=self.started_at,
            commands_seen=self.commands_seen,
            force_master=self.force_master,
            master_id=self.master_id,
        )

    def alive_sessions(self) -> set[str]:
        now = time.monotonic()
        alive = {heartbeat.session_id for heartbeat, seen in self._peers.values() if now - seen < PEER_TIMEOUT_SECONDS}
        return alive | {self.session_id}

    def alive_nodes(self) -> set[NodeId]:
        now = time.monotonic()
        alive = {node_id for node_id, (_, seen) in self._peers.items() if now - seen < PEER_TIMEOUT_SECONDS}
        return alive | {self.node_id}

    async def run(self) -> None:
        await asyncio.gather(self._send_heartbeats(), self._receive_heartbeats(), self._run_rounds())

    async def _send_heartbeats(self) -> None:
        while True:
            self.router.publish(Topic.ELECTION, self.candidacy())
            await asyncio.sleep(HEARTBEAT_SECONDS)

    async def _receive_heartbeats(self) -> None:
        while True:
            heartbeat: Heartbeat = await self._heartbeats.get()
            if heartbeat.node_id == self.node_id:
                continue
            known = self._peers.get(heartbeat.node_id)
            if heartbeat.node_id not in self.alive_nodes():
                logger.info(f"election: node {heartbeat.node_id} joined")
                self._membership_changed.set()
            elif known is not None and known[0].session_id != heartbeat.session_id:
                # Back within the peer timeout, as a new process: with a new seniority,
                # and no master running if it was the master.
                logger.info(f"election: node {heartbeat.node_id} restarted")
                self._membership_changed.set()
            self._peers[heartbeat.node_id] = (heartbeat, time.monotonic())
            if self.master_id is None:
                await self._follow_early(heartbeat)

    async def _follow_early(self, heartbeat: Heartbeat) -> None:
        alive = self.alive_nodes()
        peers = [seen for node_id, (seen, _) in self._peers.items() if node_id in alive]
        master_id = master_to_follow(self.candidacy(), heartbeat, peers)
        if master_id is not None:
            logger.info(f"election: following {master_id}, the master already elected")
            self.master_id = master_id
            await self.on_elected(master_id)

    async def _run_rounds(self) -> None:
        members = self.alive_nodes()
        self._membership_changed.set()  # the first round, once the start-up debounce is over
        while True:
            try:
                await asyncio.wait_for(self._membership_changed.wait(), timeout=HEARTBEAT_SECONDS)
            except TimeoutError:
                if self.alive_nodes() == members:
                    continue
                logger.info(f"election: nodes left: {members - self.alive_nodes()}")
            await asyncio.sleep(DEBOUNCE_SECONDS)
            self._membership_changed.clear()
            members = self.alive_nodes()
            await self.run_round(members)

    async def run_round(self, members: set[NodeId]) -> NodeId:
        self.clock += 1
        candidates = [self.candidacy()] + [
            heartbeat for node_id, (heartbeat, _) in self._peers.items() if node_id in members
        ]
        winner = choose_master(candidates)
        if winner != self.master_id:
            logger.info(f"election round {self.clock}: master is {winner}")
            self.master_id = winner
            await self.on_elected(winner)
        return winner
