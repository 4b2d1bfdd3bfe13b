"""Requests that reach an idle runner close together prefill in one step (worker/runner.py,
Gathering): a real runner loop on a real MLX engine (the tiny llama), fed through a
real pipe as its supervisor feeds it, the requests sent some milliseconds apart as the
API passes on requests a client sent at once. Without the gathering the first one is
stepped alone. The gathering's window is widened here (limits.GATHER_SECONDS) so a
loaded machine cannot make the test flaky."""

import threading
import time
from multiprocessing.connection import Pipe

import pytest

from exo.catalog.cards import card_from_model_dir
from exo.devtools.tiny_models import make_tiny_llama
from exo.engine import limits
from exo.shared.types.common import CommandId, InstanceId, ModelId, RunnerId, TaskId
from exo.shared.types.instances import EngineKind
from exo.shared.types.tasks import TextGenerationTask
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams
from exo.worker.runner import Runner
from exo.worker.runner_protocol import Shutdown, SubmitTask
from tests.support.engine import load_engine, lone_instance, set_step_tokens

RUNNER = RunnerId("runner-a")
REQUESTS = 4
SENT_APART = 0.03  # seconds between two requests reaching the runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    loaded = load_engine(model_dir)
    yield loaded
    loaded.close()


def _prefilled_per_step(engine, model_dir) -> list[set[CommandId]]:
    """Sends REQUESTS requests SENT_APART apart to a runner on `engine`; returns, for each
    step that prefilled something, the requests it prefilled."""
    steps: list[set[CommandId]] = []
    step = engine.step

    def recorded() -> list[ChunkGenerated]:
        chunks = step()
        prefilled = {chunk.command_id for chunk in chunks if chunk.prefill is not None}
        if prefilled:
            steps.append(prefilled)
        return chunks

    engine.step = recorded  # observed, not replaced: the real step runs
    ours, theirs = Pipe()
    runner = Runner(
        theirs, RUNNER, lone_instance(card_from_model_dir(model_dir, "test/model"), RUNNER, EngineKind.Mlx), engine
    )
    engine.close = lambda: None  # the module's engine outlives this runner
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        for index in range(REQUESTS):
            params = TextGenerationTaskParams(
                model=ModelId("test/model"),
                messages=[],
                prompt=[5 + index, *range(10, 60)],
                max_tokens=4,
                temperature=0.0,
            )
            task = TextGenerationTask(
                task_id=TaskId(f"task-{index}"),
                command_id=CommandId(f"request-{index}"),
                instance_id=InstanceId("instance-a"),
                origin_session="test",
                params=params,
            )
            ours.send(SubmitTask(task=task))
            time.sleep(SENT_APART)
        deadline = time.monotonic() + 60
        while sum(len(step) for step in steps) < REQUESTS or engine.has_work:
            assert time.monotonic() < deadline, f"the requests did not finish: {steps}"
            while ours.poll():
                ours.recv()
            time.sleep(0.01)
    finally:
        ours.send(Shutdown())
        while thread.is_alive():
            while ours.poll():
                ours.recv()
            thread.join(0.05)
        del engine.step, engine.close
    return steps


def test_requests_arriving_together_at_an_idle_runner_prefill_in_one_step(engine, model_dir, monkeypatch):
    set_step_tokens(monkeypatch, engine, 4096)  # room for every prompt in one step
    monkeypatch.setattr(limits, "GATHER_SECONDS", 10 * SENT_APART)
    monkeypatch.setattr(limits, "GATHER_MAX_SECONDS", 100 * SENT_APART)
    steps = _prefilled_per_step(engine, model_dir)
    assert steps[0] == {CommandId(f"request-{index}") for index in range(REQUESTS)}, steps


def test_without_gathering_the_first_request_is_stepped_alone(engine, model_dir, monkeypatch):
    set_step_tokens(monkeypatch, engine, 4096)
    monkeypatch.setattr(limits, "GATHER_SECONDS", 0.0)
    steps = _prefilled_per_step(engine, model_dir)
    assert steps[0] == {CommandId("request-0")}, steps
    assert sum(len(step) for step in steps) == REQUESTS
