"""The spare runner process a node starts with itself (worker/supervisor.py): the first
runner the worker creates is that process, which imported its engine meanwhile; one
never used exits when the worker lets it go."""

import asyncio
import time
from pathlib import Path

from exo.catalog.cards import builtin_cards
from exo.shared.types.common import RunnerId
from exo.shared.types.events import Event, RunnerStatusUpdated
from exo.shared.types.instances import EngineKind
from exo.shared.types.runners import RunnerIdle
from exo.worker.supervisor import RunnerSupervisor, SpareRunner, ran_runners, record_runners
from tests.support.engine import lone_instance

RUNNER = RunnerId("runner-a")


def test_the_first_runner_is_the_spare_process():
    async def scenario() -> None:
        spare = SpareRunner(EngineKind.LlamaCpp, verbose=False)
        statuses: asyncio.Queue[Event] = asyncio.Queue()
        supervisor = RunnerSupervisor(
            RUNNER,
            lone_instance(builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"], RUNNER, EngineKind.LlamaCpp),
            statuses.put_nowait,
            lambda _: None,
            spare=spare,
        )
        try:
            assert supervisor.process is spare.process
            first = await asyncio.wait_for(statuses.get(), timeout=60)
            assert first == RunnerStatusUpdated(runner_id=RUNNER, status=RunnerIdle())
        finally:
            await supervisor.shutdown()
        assert not spare.process.is_alive()
        assert supervisor.failure_message is None  # shut down in order

    asyncio.run(scenario())


def test_a_spare_let_go_exits():
    spare = SpareRunner(EngineKind.LlamaCpp, verbose=False)
    spare.close()
    deadline = time.monotonic() + 60
    while spare.process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spare.process.exitcode == 0


def test_a_spare_is_started_where_the_node_ran_runners_when_it_stopped(tmp_path: Path):
    assert not ran_runners(tmp_path)  # a fresh node
    record_runners(tmp_path, [RUNNER])
    assert ran_runners(tmp_path)
    record_runners(tmp_path, [])  # its instance was deleted
    assert not ran_runners(tmp_path)
