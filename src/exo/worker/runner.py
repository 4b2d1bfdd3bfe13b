"""The runner subprocess: owns one engine and one model shard, and does what its
supervisor says. Its own process, so a crash in native code cannot take the node down."""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from loguru import logger

from exo.engine import limits
from exo.engine.base import Engine
from exo.engine.kv_handoff import HandoffEngine
from exo.shared.types.common import CommandId, RunnerId, TaskId
from exo.shared.types.events import RunnerStatusUpdated, TaskStatusUpdated
from exo.shared.types.instances import EngineKind, Instance
from exo.shared.types.runners import (
    PrefixCacheStats,
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerShuttingDown,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChunkGenerated
from exo.worker.chunk_coalescing import HeldChunks
from exo.worker.kv_handoffs import RunnerHandoffs
from exo.worker.runner_protocol import (
    BecomeRunner,
    CancelRunnerTask,
    ConnectToGroup,
    LoadModel,
    RunnerInstruction,
    Shutdown,
    StartWarmup,
    SubmitTask,
)


@dataclass(frozen=True)
class Fallback:
    """Another engine for the models the runner's engine cannot run. `refusal(model_dir)`
    says why not from files every rank holds (so every rank falls back alike);
    `recorded(model_dir)` what this node found before; `refused` is the error the engine's
    load raises when it will not take the model, and `record(model_dir, model_id, why)`
    keeps that for the next load."""

    engine: Callable[[], Engine]
    refusal: Callable[[Path], str | None]
    recorded: Callable[[Path], str | None]
    record: Callable[[Path, str, str], None]
    refused: type[Exception]


class Gathering:
    """Requests that come to an idle engine close together, held for its next step
    (limits.GATHER_SECONDS): the first opens a gathering, each one submitted while it is
    open keeps it open a while longer, and the step closes it."""

    def __init__(self) -> None:
        self.open = False
        self.until = 0.0  # no step before this while open
        self.latest = 0.0  # nor after this

    def arrived(self, engine_was_idle: bool) -> None:
        now = time.monotonic()
        if engine_was_idle:
            self.open, self.latest = True, now + limits.GATHER_MAX_SECONDS
        if self.open:
            self.until = min(now + limits.GATHER_SECONDS, self.latest)

    def remaining(self) -> float:
        return max(0.0, self.until - time.monotonic()) if self.open else 0.0

    def close(self) -> None:
        self.open = False


class Runner:
    def __init__(
        self,
        conn: Connection,
        runner_id: RunnerId,
        instance: Instance,
        engine: Engine,
        fallback: Fallback | None = None,
    ) -> None:
        self.conn = conn
        self.runner_id = runner_id
        self.instance = instance
        self.shard = instance.shard_assignments.runner_to_shard[runner_id]
        self.engine = engine
        self.fallback = fallback
        # Why the runner serves on its fallback engine, once it does.
        self.engine_reason: str | None = None
        # request id (the command id) -> task id, for the tasks being generated.
        self.active: dict[CommandId, TaskId] = {}
        self.ready = False
        self._reported: RunnerStatus | None = None
        # From the usage of the requests it finished; reported with the load.
        self.prefix_cache = PrefixCacheStats()
        self.chunks = HeldChunks(self.conn.send)
        self.gathering = Gathering()
        # Disaggregated serving, where the instance has a prefill side (engine/kv_handoff.py).
        self.handoffs = (
            RunnerHandoffs(instance, engine)
            if (instance.prefill or instance.prefill_for) and isinstance(engine, HandoffEngine)
            else None
        )

    def set_status(self, status: RunnerStatus) -> None:
        self.conn.send(RunnerStatusUpdated(runner_id=self.runner_id, status=status))

    def run(self) -> None:
        self.set_status(RunnerIdle())
        while not self.following:
            # Block for instructions only when idle; while generating, take what has
            # arrived and keep stepping. A KV handoff's socket may wake an idle runner
            # instead: it steps (generate_step takes what the handoffs brought). Requests
            # that wake it are gathered for a moment first (Gathering).
            if self.conn.poll(self.gathering.remaining()) or not self.engine.has_work:
                if self.handoffs is not None and not self.conn.poll():
                    self.handoffs.wait(self.conn)
                if self.handoffs is None or self.conn.poll():
                    if not self.handle(self.conn.recv()):
                        return
                    continue
            if self.handoffs is not None:
                self._poll_handoffs()
            if self.engine.has_work:
                self.gathering.close()
                self.generate_step()
        # A follower's steps block in collectives until rank 0 leads the next one;
        # rank 0 also tells it when to shut down.
        while not self.engine.shutdown_requested:
            self.engine.step()
        self._shut_down()

    @property
    def following(self) -> bool:
        return self.engine.is_follower and self.ready

    def _shut_down(self) -> None:
        self.set_status(RunnerShuttingDown())
        if self.handoffs is not None:
            self.handoffs.close()
        self.engine.close()
        self.set_status(RunnerShutdown())

    def _load(self, model_dir: Path) -> None:
        layers = self.shard.end_layer - self.shard.start_layer
        self.set_status(RunnerLoading(layers_loaded=0, total_layers=layers))
        reported = -1

        def converted(done: int, total: int) -> None:
            # Whole percents: each status is an event every node logs.
            nonlocal reported
            percent = done * 100 // max(total, 1)
            if percent != reported:
                reported = percent
                status = RunnerLoading(total_layers=layers, converted_bytes=done, total_convert_bytes=total)
                self.set_status(status)

        def loaded(done: int, total: int) -> None:
            self.set_status(RunnerLoading(layers_loaded=done, total_layers=total))

        self.engine.load(model_dir, self.shard, loaded, converted)

    def _load_or_fall_back(self, model_dir: Path, fallback: Fallback) -> None:
        """Load with the runner's engine, or with the fallback where the engine cannot run
        the model: its files say so, this node found so before, or the load refuses it."""
        model_id = self.shard.model_card.model_id
        split, leader = self.shard.world_size > 1, self.shard.device_rank == 0
        reason = fallback.refusal(model_dir)
        if reason is None and leader:
            reason = fallback.recorded(model_dir)
            if reason is not None and split:
                # Only rank 0 loads, so only its node knows: one rank cannot change the
                # engine of a ring. Placement reads the refusal and puts the next on MLX.
                raise RuntimeError(f"llama.cpp refused {model_id} on this node before: {reason}")
        if reason is None:
            try:
                self._load(model_dir)
                return
            except fallback.refused as error:
                reason = str(error)
                fallback.record(model_dir, model_id, reason)
                if split:
                    raise
        elif leader:
            fallback.record(model_dir, model_id, reason)
        logger.info(f"{model_id} runs on MLX: {reason}")
        self.engine_reason = f"runs on MLX: {reason}"
        self.engine.close()
        self.engine = fallback.engine()
        self.engine.connect(self.instance, self.shard)
        self._load(model_dir)

    def handle(self, instruction: RunnerInstruction) -> bool:
        match instruction:
            case ConnectToGroup():
                self.set_status(RunnerConnecting())
                self.engine.connect(self.instance, self.shard)
                self.set_status(RunnerConnected())
            case LoadModel(model_dir=model_dir, draft=draft):
                if self.fallback is None:
                    self._load(Path(model_dir))
                else:
                    self._load_or_fall_back(Path(model_dir), self.fallback)
                if draft is not None:
                    draft_id, draft_dir = draft
                    self.engine.load_draft(Path(draft_dir), draft_id)
                    logger.info(f"runner {self.runner_id}: loaded draft model {draft_id}")
                self.set_status(RunnerLoaded())
            case StartWarmup():
                self.set_status(RunnerWarmingUp())
                tokens = self.engine.warm_up()
                logger.info(f"runner {self.runner_id}: warmed up with {tokens} tokens")
                self.ready = True
                self._report_load()
            case SubmitTask(task=TextGenerationTask(task_id=task_id, command_id=command_id, params=params)):
                try:
                    # A long prompt waits for its KV from the prefill runner, then is submitted.
                    if self.handoffs is None or not self.handoffs.start(command_id, params):
                        was_idle = not self.engine.has_work
                        self.engine.submit(command_id, params)
                        self.gathering.arrived(was_idle)
                except Exception as error:  # a bad prompt fails its request, not the runner
                    logger.exception("submit failed")
                    # A ValueError is the input's (a processor refusing an image); others are ours.
                    message = f"could not start generation: {error}"
                    self._fail(task_id, command_id, message, rejected=isinstance(error, ValueError))
                    return True
                self.active[command_id] = task_id
                self.conn.send(TaskStatusUpdated(task_id=task_id, status=TaskStatus.Running))
                self._report_load()
            case CancelRunnerTask(task_id=task_id):
                for command_id, active_task_id in list(self.active.items()):
                    if active_task_id == task_id:
                        if self.handoffs is None or not self.handoffs.cancel(command_id):
                            self.engine.cancel(command_id)
                        del self.active[command_id]
                        self.chunks.forget(command_id)
                        self.conn.send(ChunkGenerated(command_id=command_id, finish_reason="cancelled"))
                        self.conn.send(TaskStatusUpdated(task_id=task_id, status=TaskStatus.Cancelled))
                self._report_load()
            case Shutdown():
                self._shut_down()
                return False
        return True

    def _poll_handoffs(self) -> None:
        """Start the prefills other runners asked for; submit the requests whose KV came."""
        assert self.handoffs is not None
        for command_id, params in self.handoffs.poll(self.ready):
            task_id = self.active.get(command_id)
            if task_id is None:
                continue  # cancelled meanwhile
            try:
                self.engine.submit(command_id, params)
            except Exception as error:
                logger.exception("submit failed")
                del self.active[command_id]
                self._fail(task_id, command_id, f"could not start generation: {error}", isinstance(error, ValueError))

    def generate_step(self) -> None:
        for chunk in self.engine.step():
            if self.handoffs is not None and self.handoffs.finished(chunk):
                continue  # a prefill for another runner
            self.chunks.put(chunk)
            if chunk.finish_reason is not None:
                if chunk.stats is not None:
                    logger.info(
                        f"prompt {chunk.stats.prompt_tokens} tokens at {chunk.stats.prompt_tps:.1f} tok/s, "
                        f"generated {chunk.stats.generation_tokens} at {chunk.stats.generation_tps:.1f} tok/s"
                    )
                if chunk.usage is not None:
                    self._count_prefix_cache(chunk.usage.cached_tokens)
                task_id = self.active.pop(chunk.command_id)
                if chunk.finish_reason == "error":
                    failed = TaskStatusUpdated(
                        task_id=task_id, status=TaskStatus.Failed, error_message=chunk.error_message
                    )
                    self.conn.send(failed)
                else:
                    self.conn.send(TaskStatusUpdated(task_id=task_id, status=TaskStatus.Complete))
        self.chunks.tick()
        # Also after a step that only applied a cancellation (a split instance's ops wait
        # for the next step).
        self._report_load()

    def _fail(self, task_id: TaskId, command_id: CommandId, message: str, rejected: bool = False) -> None:
        chunk = ChunkGenerated(command_id=command_id, finish_reason="error", error_message=message, rejected=rejected)
        self.chunks.put(chunk)
        self.conn.send(TaskStatusUpdated(task_id=task_id, status=TaskStatus.Failed, error_message=message))

    def _count_prefix_cache(self, cached_tokens: int) -> None:
        stats = self.prefix_cache
        self.prefix_cache = stats.model_copy(
            update={
                "hits": stats.hits + (cached_tokens > 0),
                "misses": stats.misses + (cached_tokens == 0),
                "cached_tokens": stats.cached_tokens + cached_tokens,
            }
        )

    def _report_load(self) -> None:
        """Running and queued counts, the prefix cache's use and the memory budget, sent
        when they change (a request came or left): the status rides the usual runner ->
        worker -> event way into State."""
        running, queued = self.engine.request_counts
        running += self.handoffs.waiting if self.handoffs is not None else 0
        memory = self.engine.memory
        if running == 0 and queued == 0:
            status: RunnerStatus = RunnerReady(
                prefix_cache=self.prefix_cache, memory=memory, engine_reason=self.engine_reason
            )
        else:
            status = RunnerRunning(
                active_tasks=running,
                queued_tasks=queued,
                prefix_cache=self.prefix_cache,
                memory=memory,
                engine_reason=self.engine_reason,
            )
        if status != self._reported:
            self._reported = status
            self.set_status(status)


def _exit_when_orphaned() -> None:
    """A runner blocked in a collective never reads its pipe, so it would not notice its
    node dying; a watchdog thread ends it once the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def _mlx_engine_modules() -> None:
    import exo.engine.mlx.engine  # noqa: F401  MLX is imported only in runners


def _llamacpp_engine_modules() -> None:
    from exo.engine.llamacpp.cores import share_cores

    share_cores()  # before llama.cpp loads
    import exo.engine.llamacpp.engine  # noqa: F401


def _mlx_engine() -> Engine:
    _mlx_engine_modules()
    from exo.engine.mlx.engine import MlxEngine

    return MlxEngine()


def _llamacpp_engine() -> Engine:
    _llamacpp_engine_modules()
    from exo.engine.llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine()


def _mlx_where_llamacpp_refuses() -> Fallback:
    """Placement judged the model by its card; its config.json or tokenizer may still say
    llama.cpp cannot run it (a rope scaling, a quantization the card does not name, a
    vocab the converter cannot write), or llama.cpp's own loader may refuse it."""
    from exo.engine.llamacpp import support

    cache_dir = support.gguf_cache_dir()
    return Fallback(
        engine=_mlx_engine,
        refusal=support.dir_refusal,
        recorded=lambda model_dir: support.recorded_refusal(cache_dir, model_dir),
        record=lambda model_dir, model_id, reason: support.record_refusal(cache_dir, model_dir, model_id, reason),
        refused=support.LlamaCppRefused,
    )


def runner_main(conn: Connection, runner_id: RunnerId, instance: Instance, verbose: bool) -> None:
    """Entry point of the spawned process."""
    _become_a_runner_process()
    _serve(conn, runner_id, instance, verbose)


def spare_main(conn: Connection, engine: EngineKind, verbose: bool) -> None:
    """Entry point of a process started before the worker knows what it will run (the
    node starts one as it starts, while it loads its history and joins): it imports the
    node's engine meanwhile, most of a runner's start, then serves as told, or exits
    when the pipe closes unused."""
    _become_a_runner_process()
    if engine == EngineKind.LlamaCpp:
        _llamacpp_engine_modules()
    else:
        _mlx_engine_modules()
    try:
        told: BecomeRunner = conn.recv()
    except EOFError:
        return
    _serve(conn, told.runner_id, told.instance, verbose)


def _become_a_runner_process() -> None:
    # Ctrl-C and SIGTERM reach the whole process group; the supervisor shuts the runner
    # down in order instead, and if the node dies outright the pipe closes and we exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_when_orphaned()
    # The MLX engine uses transformers for tokenizers only; keep torch (which transformers
    # imports whenever it is installed) out: ~3 s of CPU per runner start.
    sys.modules.setdefault("torch", None)  # type: ignore[assignment]


def _serve(conn: Connection, runner_id: RunnerId, instance: Instance, verbose: bool) -> None:
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if verbose else "INFO", format=f"runner {runner_id[:8]} | {{message}}")
    if instance.engine == EngineKind.LlamaCpp:
        runner = Runner(conn, runner_id, instance, _llamacpp_engine(), _mlx_where_llamacpp_refuses())
    else:
        runner = Runner(conn, runner_id, instance, _mlx_engine())
    try:
        runner.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.warning("supervisor went away; runner exiting")
        sys.exit(1)
    except Exception as error:
        logger.exception("runner failed")
        runner.set_status(RunnerFailed(error_message=f"{type(error).__name__}: {error}"))
        sys.exit(1)
