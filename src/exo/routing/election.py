"""Choosing the master. Every node stands as a candidate; the highest (clock, seniority,
commands seen, node id) wins, so any two nodes with the same view pick the same one."""

import asyncio
import time
from collections.abc import Awaitable, Callable

from exo.routing.router import Router, Topic
from exo.shared.types.common import FrozenModel, NodeId

# How long a round collects candidacies before deciding.
ROUND_SECONDS = 0.2


class Candidate(FrozenModel):
    node_id: NodeId
    clock: int  # election rounds this node has seen
    seniority: float  # seconds this node has been up
    commands_seen: int
    force_master: bool = False


def election_key(candidate: Candidate) -> tuple[bool, int, float, int, str]:
    return (
        candidate.force_master,
        candidate.clock,
        candidate.seniority,
        candidate.commands_seen,
        candidate.node_id,
    )


def choose_master(candidates: list[Candidate]) -> NodeId:
    return max(candidates, key=election_key).node_id


class Election:
    def __init__(
        self,
        node_id: NodeId,
        router: Router,
        on_elected: Callable[[NodeId], Awaitable[None]],
        force_master: bool = False,
    ) -> None:
        self.node_id = node_id
        self.router = router
        self.on_elected = on_elected
        self.force_master = force_master
        self.clock = 0
        self.commands_seen = 0
        self.started_at = time.monotonic()
        self._ballots = router.subscribe(Topic.ELECTION)

    def candidacy(self) -> Candidate:
        return Candidate(
            node_id=self.node_id,
            clock=self.clock,
            seniority=time.monotonic() - self.started_at,
            commands_seen=self.commands_seen,
            force_master=self.force_master,
        )

    async def run_round(self) -> NodeId:
        self.clock += 1
        self.router.publish(Topic.ELECTION, self.candidacy())
        candidates: dict[NodeId, Candidate] = {}
        try:
            async with asyncio.timeout(ROUND_SECONDS):
                while True:
                    candidate: Candidate = await self._ballots.get()
                    candidates[candidate.node_id] = candidate
        except TimeoutError:
            pass
        winner = choose_master(list(candidates.values()) or [self.candidacy()])
        await self.on_elected(winner)
        return winner
