"""The spare runner process a node starts with itself (worker/supervisor.py): the first
runner the worker creates is that process, which imported its engine meanwhile; one
never used exits when the worker lets it go."""

import asyncio
import time
from pathlib import Path

from exo.catalog.cards import builtin_cards
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.events import Event, RunnerStatusUpdated
from exo.shared.types.instances import EngineKind, Instance, ShardAssignments, Sharding
from exo.shared.types.runners import RunnerIdle
from exo.shared.types.shards import PipelineShardMetadata
from exo.worker.supervisor import RunnerSupervisor, SpareRunner, ran_runners, record_runners

RUNNER = RunnerId("runner-a")


def lone_instance() -> Instance:
    card = builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"]
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    return Instance(
        instance_id=InstanceId("instance-a"),
        sharding=Sharding.Pipeline,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id), runner_to_shard={RUNNER: shard}, node_to_runner={NodeId("n"): RUNNER}
        ),
        engine=EngineKind.LlamaCpp,
    )


def test_the_first_runner_is_the_spare_process():
    async def scenario() -> None:
        spare = SpareRunner(EngineKind.LlamaCpp, verbose=False)
        statuses: asyncio.Queue[Event] = asyncio.Queue()
        supervisor = RunnerSupervisor(RUNNER, lone_instance(), statuses.put_nowait, lambda _: None, spare=spare)
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
