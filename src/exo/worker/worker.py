"""The worker: carries out the planner's decisions for this node's runners."""

import asyncio
import contextlib
import platform
import shutil
import socket
import time
from pathlib import Path
from typing import assert_never

import httpx
import psutil
from loguru import logger

from exo.catalog.model_dirs import (
    download_dir,
    download_free_bytes,
    find_local_model_dir,
    is_complete_model_dir,
    is_read_only_path,
    model_dir_name,
    models_dirs,
    partial_model_dir,
)
from exo.engine.llamacpp.support import gguf_cache_dir, recorded_refusals
from exo.routing.replica import StateReplica
from exo.routing.router import Router, Topic
from exo.shared.image_store import images_dir
from exo.shared.queries import hub_fetcher, layers_needed
from exo.shared.types.commands import DeleteInstance, MoveRingPort
from exo.shared.types.common import ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.downloads import (
    DownloadCancelled,
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
    DownloadProgress,
)
from exo.shared.types.events import (
    Event,
    NodeDownloadDeleted,
    NodeDownloadProgress,
    NodeGatheredInfo,
    RunnerStatusUpdated,
    TopologyEdgeDeleted,
    TopologyEdgeUpdated,
)
from exo.shared.types.instances import EngineKind, Instance
from exo.shared.types.nodes import MemoryInfo, NodeInfo, NodeSpeed
from exo.shared.types.runners import RunnerFailed, RunnerShutdown
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChunkGenerated
from exo.worker.download import DownloadError, download_model
from exo.worker.download.hub import PEER_HUB_PREFIX
from exo.worker.download.progress_log import ConsoleProgress, eta_seconds
from exo.worker.download.verify import PARTIAL_SUFFIX
from exo.worker.hardware import mlx_backend, nvidia_gpus, probe
from exo.worker.images import peer_api, with_image_bytes
from exo.worker.link_probes import PROBE_TIMEOUT_SECONDS, local_interfaces, probe_peer, worth_reporting
from exo.worker.planner import (
    AbandonRunner,
    CancelModelDownload,
    CancelTask,
    CreateRunner,
    DeleteFailedInstance,
    DeleteModelFiles,
    FindModel,
    ForwardTask,
    LocalRunner,
    PlannerAction,
    ReportRingPortTaken,
    RunnerStep,
    ShutdownRunner,
    StartModelDownload,
    plan,
)
from exo.worker.ring_ports import own_ring_host, ring_port_taken
from exo.worker.runner_protocol import SubmitTask
from exo.worker.speed_probe import probe_speed
from exo.worker.supervisor import RunnerSupervisor, SpareRunner, record_runners

NODE_INFO_INTERVAL_SECONDS = 10.0
DOWNLOAD_REPORT_SECONDS = 1.0
LINK_PROBE_INTERVAL_SECONDS = 3.0
# How long the spare runner process started with the node waits for a runner to become.
SPARE_RUNNER_SECONDS = 30.0
# The speed probe waits this long after the node starts, so a start (or a restart's time
# to serving) never shares the cores with it.
SPEED_PROBE_DELAY_SECONDS = 10.0
# Report memory again only when it moved this much, to keep the event log small.
MEMORY_REPORT_THRESHOLD_BYTES = 512 * 2**20


class Worker:
    def __init__(
        self,
        node_id: NodeId,
        router: Router,
        replica: StateReplica,
        exo_home: Path,
        api_port: int,
        verbose: bool,
        offline: bool = False,
        peer_token: str | None = None,
        engine: EngineKind = EngineKind.Mlx,
        sealed: bool = False,
        spare: SpareRunner | None = None,
    ) -> None:
        self.node_id = node_id
        # Started with the node; the first runner created takes it (supervisor.py).
        self.spare = spare
        self.engine = engine
        self.sealed = sealed  # its cluster messages are sealed by a cluster secret
        # Presented on the other nodes' peer endpoints when their API needs a key.
        self.peer_token = peer_token
        self.router = router
        self.replica = replica
        self.exo_home = exo_home
        self.api_port = api_port
        self.verbose = verbose
        self.offline = offline
        self.supervisors: dict[RunnerId, RunnerSupervisor] = {}
        self._downloads: dict[ModelId, asyncio.Task[None]] = {}
        # The latest progress of each running download (State gets one a second).
        self._progress: dict[ModelId, DownloadOngoing] = {}
        self._runner_statuses: dict[RunnerId, RunnerStatusUpdated] = {}
        self.forwarded: dict[RunnerId, set[TaskId]] = {}
        self.exited_at: dict[RunnerId, float] = {}
        self._wake = asyncio.Event()
        # This node's measured speeds (speed_probe.py): None until measured.
        self.speed: NodeSpeed | None = None
        self._speed_measured = False
        replica.on_change(lambda _state: self._wake.set())

    def emit(self, event: Event) -> None:
        self.router.publish(Topic.LOCAL_EVENTS, event)

    def _on_runner_event(self, event: Event) -> None:
        if isinstance(event, RunnerStatusUpdated):
            self._runner_statuses[event.runner_id] = event
            if isinstance(event.status, RunnerFailed):
                self._report_new_refusals()
        self.emit(event)
        self._wake.set()

    def _report_new_refusals(self) -> None:
        """A runner that failed may have just recorded that llama.cpp refused its model.
        Reported before the failure, not at the next gathering, so the master places a
        split of it on MLX before any rank restarts or gives up on its peer."""
        known = self.replica.state.nodes.get(self.node_id)
        refusals = llamacpp_refusals(self.exo_home, self.engine)
        if known is not None and refusals != known.llamacpp_refusals:
            self.emit(NodeGatheredInfo(info=known.model_copy(update={"llamacpp_refusals": refusals})))

    def report_runner_statuses(self) -> None:
        for runner_id in self.supervisors:
            if runner_id in self._runner_statuses:
                self.emit(self._runner_statuses[runner_id])

    def _on_chunk(self, chunk: ChunkGenerated) -> None:
        self.router.publish(Topic.CHUNKS, chunk)

    async def run(self) -> None:
        await asyncio.gather(
            self._report_node_info(),
            self._plan_loop(),
            self._probe_links(),
            self._measure_speed(),
            self._let_the_spare_go(),
        )

    async def _let_the_spare_go(self) -> None:
        """A node that has no runner to start soon after it starts keeps no spare."""
        await asyncio.sleep(SPARE_RUNNER_SECONDS)
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close()
            await asyncio.to_thread(spare.process.join, 10)  # no zombie left

    async def _measure_speed(self) -> None:
        await asyncio.sleep(SPEED_PROBE_DELAY_SECONDS)
        self.speed = await asyncio.to_thread(probe_speed, self.engine)
        self._speed_measured = True

    async def _probe_links(self) -> None:
        headers = {"Authorization": f"Bearer {self.peer_token}"} if self.peer_token else None
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_SECONDS, headers=headers) as client:
            while True:
                await asyncio.sleep(LINK_PROBE_INTERVAL_SECONDS)
                state = self.replica.state
                own_ips = {i.ip for i in local_interfaces()}
                for peer in list(state.nodes.values()):
                    if peer.node_id == self.node_id:
                        continue
                    known = state.topology.connection(self.node_id, peer.node_id)
                    connection = await probe_peer(client, self.node_id, peer, own_ips)
                    if connection is None and known is not None:
                        self.emit(TopologyEdgeDeleted(source=self.node_id, sink=peer.node_id))
                    elif connection is not None and worth_reporting(known, connection):
                        self.emit(TopologyEdgeUpdated(connection=connection))

    async def _report_node_info(self) -> None:
        last_sent = 0.0
        while True:
            state = self.replica.state
            known = state.nodes.get(self.node_id)
            due = time.monotonic() - last_sent >= NODE_INFO_INTERVAL_SECONDS
            # Report again when the cluster has forgotten this node (it timed out, or its
            # first report went out before there was a master), when memory moved a lot,
            # or when anything else differs: a node restarted on its old home with another
            # API port or engine is known from its event log as it was.
            if known is None or due or self._speed_measured:
                self._speed_measured = False
                # In a thread: nvidia-smi may take a moment to answer.
                info = await asyncio.to_thread(
                    gather_node_info,
                    self.node_id,
                    self.exo_home,
                    self.api_port,
                    self.engine,
                    self.sealed,
                    self.speed,
                )
                if known is None or _differs(known, info):
                    self.emit(NodeGatheredInfo(info=info))
                last_sent = time.monotonic()
            await asyncio.sleep(1.0)

    async def _plan_loop(self) -> None:
        while True:
            self._wake.clear()
            action = plan(
                self.node_id, self.replica.state, self._local_runners(), time.monotonic(), frozenset(self._downloads)
            )
            if action is None:
                # Re-plan at least every half second: restart backoffs are time-based.
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except TimeoutError:
                    pass
                continue
            logger.debug(f"worker: {action}")
            try:
                await self._execute(action)
            except Exception:
                logger.exception(f"worker: {action} failed")
                await asyncio.sleep(0.5)

    def _local_runners(self) -> dict[RunnerId, LocalRunner]:
        local = {}
        for runner_id, supervisor in self.supervisors.items():
            if supervisor.exited and runner_id not in self.exited_at:
                self.exited_at[runner_id] = time.monotonic()
            local[runner_id] = LocalRunner(
                runner_id=runner_id,
                instance_id=supervisor.instance.instance_id,
                sent=frozenset(supervisor.sent),
                forwarded=frozenset(self.forwarded.get(runner_id, ())),
                in_flight=frozenset(supervisor.in_flight),
                exited=supervisor.exited,
                exited_at=self.exited_at.get(runner_id),
                attempt=supervisor.attempt,
                hosts=tuple(supervisor.instance.hosts),
                failure=supervisor.failure_message,
                status=supervisor.status,
            )
        return local

    async def _execute(self, action: PlannerAction) -> None:
        state = self.replica.state
        match action:
            case FindModel(instance_id=instance_id, draft=draft):
                instance = state.instances[instance_id]
                model_id = instance.draft_model if draft and instance.draft_model else instance.model_id
                previous = state.downloads.get(self.node_id, {}).get(model_id)
                self._find_model(model_id, None if draft else layers_needed(instance, self.node_id))
                # Wait for our report to come back, so the planner sees it.
                await self.replica.wait_for(
                    lambda s: s.downloads.get(self.node_id, {}).get(model_id) is not previous, timeout=10
                )
            case CreateRunner(instance_id=instance_id, runner_id=runner_id, attempt=attempt):
                host = own_ring_host(state.instances[instance_id], runner_id)
                if host is not None and await asyncio.to_thread(ring_port_taken, host):
                    await self._move_ring_port(state.instances[instance_id], host)
                    return
                old = self.supervisors.pop(runner_id, None)
                if old is not None:
                    await old.shutdown()
                stale = state.runners.get(runner_id)
                if old is None and stale is not None and not isinstance(stale, RunnerFailed | RunnerShutdown):
                    # Left by this node's previous process (a restart): the other ranks
                    # step through connect and load on it, and must wait for the new one.
                    self._on_runner_event(RunnerStatusUpdated(runner_id=runner_id, status=RunnerShutdown()))
                self.exited_at.pop(runner_id, None)
                self.forwarded[runner_id] = set()
                spare, self.spare = self.spare, None
                self.supervisors[runner_id] = RunnerSupervisor(
                    runner_id,
                    state.instances[instance_id],
                    on_event=self._on_runner_event,
                    on_chunk=self._on_chunk,
                    verbose=self.verbose,
                    attempt=attempt,
                    spare=spare,
                )
                record_runners(self.exo_home, self.supervisors)
            case ShutdownRunner(runner_id=runner_id):
                supervisor = self.supervisors.pop(runner_id)
                record_runners(self.exo_home, self.supervisors)
                await supervisor.shutdown()
                self.forwarded.pop(runner_id, None)
                self.exited_at.pop(runner_id, None)
            case AbandonRunner(runner_id=runner_id, reason=reason):
                logger.warning(f"runner {runner_id}: {reason}; stopping it so the instance can restart")
                self.supervisors[runner_id].abandon(reason)
            case ReportRingPortTaken(instance_id=instance_id, runner_id=runner_id):
                instance = state.instances[instance_id]
                host = own_ring_host(instance, runner_id)
                if host is not None:
                    await self._move_ring_port(instance, host)
            case DeleteFailedInstance(instance_id=instance_id, reason=reason):
                logger.error(f"giving up on instance {instance_id}: {reason}")
                self.router.publish(Topic.COMMANDS, DeleteInstance(instance_id=instance_id, reason=reason))
                # Wait for the deletion to come back before planning again.
                await self.replica.wait_for(lambda s: instance_id not in s.instances, timeout=10)
            case RunnerStep(runner_id=runner_id, instruction=instruction):
                self.supervisors[runner_id].send(instruction)
            case ForwardTask(runner_id=runner_id, task_id=task_id):
                # Tasks gone from State never come back: forget them, so the set does
                # not grow with every request the runner has served.
                forwarded = self.forwarded[runner_id]
                forwarded.intersection_update(state.tasks)
                forwarded.add(task_id)
                task = await with_image_bytes(
                    state.tasks[task_id], images_dir(self.exo_home), state, self.node_id, self.peer_token
                )
                # Taking an image from a peer may outlast the runner.
                if runner_id in self.supervisors:
                    self.supervisors[runner_id].send(SubmitTask(task=task))
            case CancelTask(runner_id=runner_id, task_id=task_id):
                self.supervisors[runner_id].cancel(task_id)
            case StartModelDownload(model_id=model_id, layers=layers):
                previous = state.downloads.get(self.node_id, {}).get(model_id)
                self._find_model(model_id, layers)
                await self.replica.wait_for(
                    lambda s: s.downloads.get(self.node_id, {}).get(model_id) is not previous, timeout=10
                )
            case CancelModelDownload(model_id=model_id):
                await self._cancel_download(model_id)
            case DeleteModelFiles(model_id=model_id):
                await self._delete_files(model_id)
            case _:
                assert_never(action)

    async def _move_ring_port(self, instance: Instance, host: str) -> None:
        """Asks the master to move this rank off `host`, taken on this node, and waits
        for the instance's new addresses (its runners then restart on them)."""
        logger.warning(f"ring port {host} of instance {instance.instance_id} is taken on this node; asking for another")
        self.router.publish(
            Topic.COMMANDS, MoveRingPort(instance_id=instance.instance_id, node_id=self.node_id, host=host)
        )
        with contextlib.suppress(TimeoutError):
            await self.replica.wait_for(lambda s: _ring_moved(s, instance), timeout=10)

    def _find_model(self, model_id: ModelId, layers: tuple[int, int] | None) -> None:
        """Use a local copy, or download one (or the files of `layers`) in the background,
        reporting progress."""
        model_dir = find_local_model_dir(model_id, self.exo_home)
        if model_dir is not None:
            self._report_download(model_id, _completed(model_dir, None))
        elif self.offline:
            message = f"{model_id} is not in any models directory on node {self.node_id}, and the node is offline"
            self._report_download(model_id, DownloadFailed(error_message=message))
        else:
            self._report_download(model_id, DownloadPending())
            task = asyncio.create_task(self._download(model_id, layers), name=f"download {model_id}")
            self._downloads[model_id] = task

    async def _download(self, model_id: ModelId, layers: tuple[int, int] | None) -> None:
        last_report = 0.0
        console = ConsoleProgress(model_id)
        target = download_dir(self.exo_home, model_id)
        # Where the files arrive: this node's peer hub serves them from there meanwhile.
        arriving = str(partial_model_dir(target, model_id))

        def on_progress(downloaded: int, total: int, bytes_per_second: float) -> None:
            nonlocal last_report
            progress = DownloadOngoing(
                downloaded_bytes=downloaded,
                total_bytes=total,
                bytes_per_second=bytes_per_second,
                eta_seconds=eta_seconds(downloaded, total, bytes_per_second),
                path=arriving,
            )
            self._progress[model_id] = progress
            console.update(downloaded, total, bytes_per_second)
            # One event a second is plenty for a progress bar, and keeps the log small.
            if time.monotonic() - last_report >= DOWNLOAD_REPORT_SECONDS:
                last_report = time.monotonic()
                self._report_download(model_id, progress)

        try:
            path = await download_model(
                model_id,
                target,
                on_progress,
                layers=layers,
                peers=self._peers_holding(model_id),
                peer_token=self.peer_token,
                peer_sources=lambda file, weight_map: self._peer_sources(model_id, file, weight_map),
            )
            outcome: DownloadProgress = _completed(path, None if is_complete_model_dir(path) else layers)
        except DownloadError as error:
            outcome = DownloadFailed(error_message=str(error))
        except BaseException:
            self._downloads.pop(model_id, None)
            self._progress.pop(model_id, None)
            raise
        self._report_download(model_id, outcome)
        # Still "downloading" until State shows the outcome, or the planner would see the
        # Pending record and look again.
        with contextlib.suppress(TimeoutError):
            await self.replica.wait_for(
                lambda s: s.downloads.get(self.node_id, {}).get(model_id) == outcome, timeout=10
            )
        self._downloads.pop(model_id, None)
        self._progress.pop(model_id, None)

    async def _stop_download(self, model_id: ModelId) -> DownloadOngoing | None:
        """Cancels this node's download of the model, if one runs; its last progress."""
        progress = self._progress.get(model_id)
        task = self._downloads.get(model_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        return progress

    async def _cancel_download(self, model_id: ModelId) -> None:
        progress = await self._stop_download(model_id)
        if progress is None:  # a record left by an earlier run of this node
            record = self.replica.state.downloads.get(self.node_id, {}).get(model_id)
            progress = record if isinstance(record, DownloadOngoing) else None
        cancelled = DownloadCancelled(
            downloaded_bytes=progress.downloaded_bytes if progress else 0,
            total_bytes=progress.total_bytes if progress else 0,
        )
        logger.info(f"cancelled the download of {model_id}; {cancelled.downloaded_bytes} bytes kept for a resume")
        self._report_download(model_id, cancelled)
        await self.replica.wait_for(
            lambda s: isinstance(s.downloads.get(self.node_id, {}).get(model_id), DownloadCancelled), timeout=10
        )

    async def _delete_files(self, model_id: ModelId) -> None:
        """Deletes the model's files from this node's writable models dirs, a partial
        download's too; a copy in a read-only dir stays, and is reported again."""
        await self._stop_download(model_id)
        for models_dir in models_dirs(self.exo_home):
            for path in (models_dir / model_dir_name(model_id), partial_model_dir(models_dir, model_id)):
                if path.is_dir() and not is_read_only_path(path):
                    await asyncio.to_thread(shutil.rmtree, path)
                    logger.info(f"deleted {path}")
        self.emit(NodeDownloadDeleted(node_id=self.node_id, model_id=model_id))
        await self.replica.wait_for(lambda s: model_id not in s.download_orders.get(self.node_id, {}), timeout=10)
        remaining = find_local_model_dir(model_id, self.exo_home)
        if remaining is not None:
            self._report_download(model_id, _completed(remaining, None))

    def _peers_holding(self, model_id: ModelId) -> dict[str, frozenset[str]]:
        """Peer hub endpoints of the nodes that hold files of the model, with those files."""
        state = self.replica.state
        peers = {}
        for node_id, records in state.downloads.items():
            record = records.get(model_id)
            endpoint = self._peer_hub(state, node_id)
            if isinstance(record, DownloadCompleted) and endpoint is not None:
                peers[endpoint] = frozenset(record.files)
        return peers

    def _peer_sources(self, model_id: ModelId, file: str, weight_map: dict[str, str] | None) -> list[str]:
        """The peer hubs to take `file` from, as State says now: those of the nodes whose
        record lists it (some finished it after this download began), then that of the
        node taking it from the hub (shared/queries.py's hub_fetcher), to stream it as it
        arrives there, unless that is this node. Called from the download's thread; State
        is replaced, never mutated."""
        state = self.replica.state
        holders = [
            node_id
            for node_id, records in state.downloads.items()
            if isinstance(record := records.get(model_id), DownloadCompleted) and file in record.files
        ]
        fetcher = hub_fetcher(state, model_id, file, weight_map)
        hubs = [self._peer_hub(state, node_id) for node_id in [*holders, *([fetcher] if fetcher else [])]]
        return [hub for hub in dict.fromkeys(hubs) if hub is not None]

    def _peer_hub(self, state: State, node_id: NodeId) -> str | None:
        """Another node's peer hub endpoint, if this node has a link to it."""
        base = peer_api(state, self.node_id, node_id)
        return None if base is None else f"{base}{PEER_HUB_PREFIX}"

    def _report_download(self, model_id: ModelId, progress: DownloadProgress) -> None:
        self.emit(NodeDownloadProgress(node_id=self.node_id, model_id=model_id, progress=progress))

    async def close(self) -> None:
        if self.spare is not None:
            self.spare.close()
        for download in self._downloads.values():
            download.cancel()
        for supervisor in list(self.supervisors.values()):
            await supervisor.shutdown()
        self.supervisors.clear()


def _ring_moved(state: State, instance: Instance) -> bool:
    current = state.instances.get(instance.instance_id)
    return current is None or current.hosts != instance.hosts


def _completed(model_dir: Path, layers: tuple[int, int] | None) -> DownloadCompleted:
    """The record of a model dir (or a download dir holding the files of `layers`)."""
    files = sorted(f for f in model_dir.iterdir() if f.is_file() and not f.name.endswith(PARTIAL_SUFFIX))
    return DownloadCompleted(
        total_bytes=sum(f.stat().st_size for f in files),
        path=str(model_dir),
        files=[f.name for f in files],
        layers=layers,
        read_only=is_read_only_path(model_dir),
    )


def gather_node_info(
    node_id: NodeId,
    exo_home: Path,
    api_port: int,
    engine: EngineKind = EngineKind.Mlx,
    sealed: bool = False,
    speed: NodeSpeed | None = None,
) -> NodeInfo:
    memory = psutil.virtual_memory()
    hardware = probe()
    return NodeInfo(
        node_id=node_id,
        friendly_name=socket.gethostname(),
        os=f"{platform.system()} {platform.machine()}",
        backend=mlx_backend(hardware),
        engine=engine,
        sealed=sealed,
        llamacpp_refusals=llamacpp_refusals(exo_home, engine),
        cpu_count=psutil.cpu_count() or 1,
        memory=MemoryInfo(total_bytes=memory.total, available_bytes=memory.available),
        gpus=nvidia_gpus(hardware),
        disk_available_bytes=download_free_bytes(exo_home),
        api_port=api_port,
        speed=speed,
        interfaces=local_interfaces(),
    )


def llamacpp_refusals(exo_home: Path, engine: EngineKind) -> dict[ModelId, str]:
    """The models llama.cpp refused on this node (records beside its GGUF cache)."""
    if engine != EngineKind.LlamaCpp:
        return {}
    return {ModelId(model_id): reason for model_id, reason in recorded_refusals(gguf_cache_dir(exo_home)).items()}


def _differs(known: NodeInfo, info: NodeInfo) -> bool:
    """Whether a fresh gathering is worth an event: free memory (RAM or a GPU's) that
    moved a lot, or any change but the wobble of free memory and disk."""
    free = [info.memory.available_bytes, *(gpu.free_bytes for gpu in info.gpus)]
    known_free = [known.memory.available_bytes, *(gpu.free_bytes for gpu in known.gpus)]
    pairs = zip(free, known_free, strict=False)
    moved = any(abs(now - before) > MEMORY_REPORT_THRESHOLD_BYTES for now, before in pairs)
    return moved or _without_free(info) != _without_free(known)


def _without_free(info: NodeInfo) -> NodeInfo:
    return info.model_copy(
        update={
            "memory": info.memory.model_copy(update={"available_bytes": 0}),
            "gpus": [gpu.model_copy(update={"free_bytes": 0}) for gpu in info.gpus],
            "disk_available_bytes": 0,
        }
    )
