"""Watching instances come up: the one loop behind GET /instance/await and a request that
waits for the model it placed."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from exo.api.placing import PLACEMENT_VISIBLE_SECONDS
from exo.api.port import ClusterPort
from exo.shared.queries import is_serving, runner_failures, runner_statuses
from exo.shared.types.common import InstanceId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.state import State


async def state_changes(
    cluster: ClusterPort, every: float, interrupt: "asyncio.Future[Any] | None" = None
) -> AsyncIterator[State]:
    """State now, then again whenever it changes and at least every `every` seconds;
    ends when `interrupt` completes."""
    state = cluster.state
    while interrupt is None or not interrupt.done():
        yield state
        changed = asyncio.ensure_future(cluster.wait_for(lambda s, seen=state: s is not seen, timeout=every))
        waiting = {changed} if interrupt is None else {changed, interrupt}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
        state = cluster.state


@dataclass(frozen=True)
class InstancesSeen:
    """One look at the watched instances."""

    state: State
    instances: list[Instance]
    waited: float
    # Why the watched instance is not there (deleted, or never showed up), if it is not.
    gone: str | None

    @property
    def ready(self) -> Instance | None:
        return next((i for i in self.instances if is_serving(self.state, i)), None)

    @property
    def statuses(self) -> dict[str, RunnerStatus | None]:
        return {r: s for i in self.instances for r, s in runner_statuses(self.state, i).items()}

    @property
    def failures(self) -> list[str]:
        return [message for i in self.instances for message in runner_failures(self.state, i)]


async def watch_instances(
    cluster: ClusterPort,
    instance_id: str | None = None,
    model_id: str | None = None,
    every: float = 1.0,
    interrupt: "asyncio.Future[Any] | None" = None,
) -> AsyncIterator[InstancesSeen]:
    """The instance (or every instance of the model), now and after every change of State.
    A placement takes a moment to reach State; after PLACEMENT_VISIBLE_SECONDS, or once
    State records its deletion, a missing instance is gone."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async for state in state_changes(cluster, every, interrupt):
        instances = [
            i
            for i in state.instances.values()
            if (instance_id is None or i.instance_id == instance_id) and (model_id is None or i.model_id == model_id)
        ]
        waited = loop.time() - started
        gone = None
        if instance_id is not None and not instances:
            deleted = state.instance_deletions.get(InstanceId(instance_id))
            if deleted is not None:
                gone = f"instance {instance_id} was deleted: {deleted}"
            elif waited > PLACEMENT_VISIBLE_SECONDS:
                gone = f"instance {instance_id} does not exist"
        yield InstancesSeen(state, instances, waited, gone)
