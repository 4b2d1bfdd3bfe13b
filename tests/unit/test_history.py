"""Snapshots and compaction of a node's history (shared/history.py, routing/replica.py):
State goes through a snapshot exactly, a snapshot plus the events after it rebuilds the
State a full replay does, old segments and snapshots go, a replica restarts from its
snapshot and tail, and one that needs events nobody holds any more takes the master's
State instead."""

import random
from pathlib import Path

import pytest

from exo.catalog.cards import builtin_cards
from exo.routing import replica as replica_module
from exo.routing.replica import StateReplica
from exo.routing.router import Router, Topic
from exo.shared.apply import apply
from exo.shared.history import History
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import AddCustomModelCard, RequestEventLog, StartDownload
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.downloads import DownloadCompleted, DownloadOngoing
from exo.shared.types.events import (
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadOrdered,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceRingMoved,
    MasterElected,
    NodeDownloadProgress,
    NodeGatheredInfo,
    NodeTimedOut,
    RunnerStatusUpdated,
    TaskCreated,
    TaskDeleted,
    TaskStatusUpdated,
    TopologyEdgeDeleted,
    TopologyEdgeUpdated,
)
from exo.shared.types.runners import RunnerIdle, RunnerLoading, RunnerReady, RunnerRunning
from exo.shared.types.state import State, StateDigest, StateSnapshot, state_digest
from exo.shared.types.tasks import TaskStatus
from exo.shared.types.topology import Connection
from tests.unit.test_apply import NODE_A, NODE_B, node_info, task, two_rank_instance

EVENTS = 700


def random_history(card: ModelCard, count: int, seed: int = 7) -> list[IndexedEvent]:
    """A long, varied sequence that a cluster could write: every event kind, on ids that
    exist (and some that no longer do), so each apply case is taken many times."""
    rng = random.Random(seed)
    events: list[Event] = [MasterElected(node_id=NODE_A), NodeGatheredInfo(info=node_info(NODE_A))]
    instances: list[str] = []
    tasks: list[str] = []
    while len(events) < count:
        roll = rng.random()
        n = len(events)
        if roll < 0.08 or not instances:
            instance_id = f"inst-{n}"
            instances.append(instance_id)
            events.append(InstanceCreated(instance=two_rank_instance(card, instance_id, (f"ra-{n}", f"rb-{n}"))))
        elif roll < 0.12:
            events.append(InstanceDeleted(instance_id=InstanceId(instances.pop(0)), reason=f"reason {n}"))
        elif roll < 0.35:
            task_id = f"task-{n}"
            tasks.append(task_id)
            events.append(TaskCreated(task=task(rng.choice(instances), task_id)))
        elif roll < 0.5 and tasks:
            status = rng.choice([TaskStatus.Running, TaskStatus.Complete, TaskStatus.Failed])
            events.append(TaskStatusUpdated(task_id=TaskId(rng.choice(tasks)), status=status, error_message=None))
        elif roll < 0.6 and tasks:
            events.append(TaskDeleted(task_id=TaskId(tasks.pop(rng.randrange(len(tasks))))))
        elif roll < 0.72:
            instance_id = rng.choice(instances)
            runner = RunnerId(f"r{rng.choice('ab')}-{instance_id.split('-')[1]}")
            status = rng.choice([RunnerIdle(), RunnerLoading(), RunnerReady(), RunnerRunning(active_tasks=n % 5)])
            events.append(RunnerStatusUpdated(runner_id=runner, status=status))
        elif roll < 0.76:
            events.append(NodeGatheredInfo(info=node_info(rng.choice([NODE_A, NODE_B]))))
        elif roll < 0.78:
            events.append(NodeTimedOut(node_id=NODE_B))
        elif roll < 0.82:
            model_id = f"acme/custom-{n % 3}"
            custom = card.model_copy(update={"model_id": model_id})
            events.append(
                CustomModelCardAdded(card=custom)
                if rng.random() < 0.6
                else CustomModelCardDeleted(model_id=ModelId(model_id))
            )
        elif roll < 0.87:
            progress = rng.choice(
                [
                    DownloadOngoing(downloaded_bytes=n, total_bytes=10 * n),
                    DownloadCompleted(total_bytes=n, path=f"/models/{n}"),
                ]
            )
            events.append(NodeDownloadProgress(node_id=NODE_B, model_id=ModelId(card.model_id), progress=progress))
        elif roll < 0.9:
            order = rng.choice(["start", "cancel", "delete"])
            events.append(DownloadOrdered(node_id=NODE_B, model_id=ModelId(card.model_id), order=order, layers=None))
        elif roll < 0.95:
            link = Connection(source=NODE_A, sink=NODE_B, sink_ip="10.0.0.2", latency_ms=n / 100, bandwidth_mbps=9400)
            events.append(
                TopologyEdgeUpdated(connection=link)
                if rng.random() < 0.7
                else TopologyEdgeDeleted(source=NODE_A, sink=NODE_B)
            )
        elif roll < 0.97:
            hosts = [f"10.0.0.1:{5000 + n}", f"10.0.0.2:{5000 + n}"]
            events.append(InstanceRingMoved(instance_id=InstanceId(rng.choice(instances)), hosts=hosts, reason="taken"))
        else:
            events.append(MasterElected(node_id=rng.choice([NODE_A, NODE_B])))
    return [IndexedEvent(idx=i, event=e) for i, e in enumerate(events)]


def replay(history: list[IndexedEvent], state: State | None = None) -> State:
    state = state or State()
    for indexed in history:
        state = apply(state, indexed)
    return state


@pytest.fixture
def card() -> ModelCard:
    return builtin_cards()["mlx-community/DeepSeek-V4-Flash"]


@pytest.fixture
def history(card: ModelCard) -> list[IndexedEvent]:
    return random_history(card, EVENTS)


def test_state_goes_through_a_snapshot_exactly(history: list[IndexedEvent]):
    state = State()
    kinds_seen = set()
    for indexed in history:
        state = apply(state, indexed)
        kinds_seen.add(indexed.event.kind)
        if indexed.idx % 50 == 0:
            assert State.model_validate_json(state.model_dump_json()) == state
    assert state.tasks and state.instances and state.runners and state.custom_model_cards
    assert len(kinds_seen) >= 15, kinds_seen


def test_a_snapshot_and_its_tail_rebuild_the_state_of_a_full_replay(tmp_path: Path, history: list[IndexedEvent]):
    full = replay(history)
    directory = tmp_path / "history"
    log = History(directory)
    state = State()
    snapshot_at = {97, 250, 251, 400, 650}
    for indexed in history:
        log.append(indexed)
        state = apply(state, indexed)
        if indexed.idx in snapshot_at:
            log.write_snapshot(state)
            # What a node restarted here rebuilds: its newest snapshot plus the tail.
            log.close()
            log = History(directory)
            newest = log.snapshot()
            assert newest == state
            assert replay(list(log.since(indexed.idx + 1)), newest) == state
    log.close()

    log = History(directory)
    newest = log.snapshot()
    assert newest is not None and newest.last_event_applied_idx == 650
    assert replay(list(log.since(651)), newest) == full
    # Kept: the two newest snapshots and the events after the older one, nothing else.
    assert log.snapshot_indices() == [400, 650]
    assert log.start == 401 and len(log) == EVENTS
    assert list(log.since(0)) == history[401:] == log[:]
    assert log[401] == history[401] and log[-1] == history[-1]
    with pytest.raises(IndexError):
        log[400]
    names = sorted(path.name for path in directory.iterdir())
    assert names == [
        "events-000000000401.jsonl",
        "events-000000000651.jsonl",
        "snapshot-000000000400.json",
        "snapshot-000000000650.json",
    ]
    log.close()


def test_cutting_the_history_before_a_snapshot_drops_the_snapshot(tmp_path: Path, history: list[IndexedEvent]):
    # A node whose history went apart at event 500 (a partition) keeps 0..499 only.
    log = History(tmp_path / "history")
    state = State()
    for indexed in history[:600]:
        log.append(indexed)
        state = apply(state, indexed)
        if indexed.idx in (300, 550):
            log.write_snapshot(state)
    log.truncate(500)
    assert log.snapshot_indices() == [300] and len(log) == 500
    from_master = IndexedEvent(idx=500, event=MasterElected(node_id=NODE_B))
    log.append(from_master)
    log.close()
    log = History(tmp_path / "history")
    assert replay(list(log.since(301)), log.snapshot()) == replay([*history[:500], from_master])
    log.close()


def test_a_home_from_before_snapshots_keeps_its_log(tmp_path: Path, history: list[IndexedEvent]):
    legacy = tmp_path / "event_log.jsonl"
    legacy.write_bytes(b"".join(e.model_dump_json().encode() + b"\n" for e in history[:40]))
    replica = StateReplica(Router(NodeId("me")), tmp_path / "history", legacy_log=legacy)
    assert replica.state == replay(history[:40]) and not legacy.exists()
    replica.close()


def test_a_replica_snapshots_every_n_events_and_restarts_from_the_newest(
    tmp_path: Path, history: list[IndexedEvent], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(replica_module, "SNAPSHOT_EVENTS", 100)
    replica = StateReplica(Router(NodeId("me")), tmp_path / "history")
    for indexed in history:
        replica.append(indexed)
    assert replica.state == replay(history)
    assert replica.history.snapshot_indices() == [599, 699]
    assert replica.head() == history[-1]
    replica.close()

    restarted = StateReplica(Router(NodeId("me")), tmp_path / "history")
    assert restarted.state == replay(history)
    assert restarted.history.start == 600
    restarted.close()


def test_a_replica_behind_the_masters_oldest_event_takes_its_snapshot(tmp_path: Path, history: list[IndexedEvent]):
    """What the master sends a node that asks for events it compacted away."""
    master_state = replay(history[:500])
    behind = StateReplica(Router(NodeId("behind")), tmp_path / "behind")
    for indexed in history[:100]:
        behind.append(indexed)
    behind.receive(history[520])  # early: waits for 500..519
    behind.receive(StateSnapshot(snapshot=master_state))
    assert behind.state == master_state
    for indexed in history[500:]:
        behind.receive(indexed)
    assert behind.state == replay(history)
    assert behind.history.snapshot_indices() == [499] and behind.history.start == 500
    # A snapshot older than what the node holds changes nothing.
    behind.receive(StateSnapshot(snapshot=replay(history[:300])))
    assert behind.state == replay(history)
    behind.close()

    restarted = StateReplica(Router(NodeId("behind")), tmp_path / "behind")
    assert restarted.state == replay(history)
    restarted.close()


def test_a_history_apart_before_the_oldest_event_held_starts_over_from_the_masters_state(
    tmp_path: Path, card: ModelCard, monkeypatch: pytest.MonkeyPatch
):
    """A partition's losing side that compacted past the point where it went apart: it
    cannot cut its history there, so it takes the master's State and asks again for the
    users' writes its own State holds (here a card and its own download order, both in
    events it no longer holds)."""
    monkeypatch.setattr(replica_module, "SNAPSHOT_EVENTS", 50)
    me, master = NodeId("me"), NodeId("master")
    router = Router(me)
    router.master_elected(me)  # commands go out at once, to the queue below
    commands = router.subscribe(Topic.COMMANDS)
    masters = random_history(card, 260)
    minority = card.model_copy(update={"model_id": "acme/minority"})
    apart: list[Event] = [NodeGatheredInfo(info=node_info(NODE_A))] * 80
    apart[10] = CustomModelCardAdded(card=minority)
    apart[11] = DownloadOrdered(node_id=me, model_id=ModelId(card.model_id), order="start", layers=(0, 2))
    ours = masters[:120] + [IndexedEvent(idx=120 + i, event=e) for i, e in enumerate(apart)]
    replica = StateReplica(router, tmp_path / "history", node_id=me)
    for indexed in ours:
        replica.append(indexed)
    replica.master_id = master
    assert replica.history.start == 150 and masters[150] != ours[150]

    replica.receive(masters[150], master)
    request = commands.get_nowait()
    assert isinstance(request, RequestEventLog) and request.since_idx == -1
    replica.receive(masters[200], master)  # ignored until the State comes
    replica.receive(StateSnapshot(snapshot=replay(masters)), master)

    assert replica.state == replay(masters)
    asked = [commands.get_nowait() for _ in range(commands.qsize())]
    # (Cards the master deleted after the split come back too: the node cannot tell.)
    assert minority in [c.card for c in asked if isinstance(c, AddCustomModelCard)]
    starts = [(c.node_id, c.model_id, c.layers) for c in asked if isinstance(c, StartDownload)]
    assert starts == [(me, card.model_id, (0, 2))]
    replica.close()


def test_a_master_behind_the_winner_asks_again_for_its_terms_writes_when_it_takes_a_snapshot(
    tmp_path: Path, card: ModelCard
):
    """The losing side's master of a partition, behind the winner when it heals, asks for
    events the winner has compacted: the winner sends its State, where no event can be
    compared. The card written in its term is asked for again; a node that was not master
    takes the same snapshot and asks for nothing (the card the winner lacks may have been
    deleted there). Before, the term's card was lost: the partition test failed on it."""
    me, master = NodeId("me"), NodeId("master")
    masters = random_history(card, 260)
    minority = card.model_copy(update={"model_id": "acme/minority"})
    apart: list[Event] = [NodeGatheredInfo(info=node_info(NODE_A))] * 10
    apart[4] = CustomModelCardAdded(card=minority)
    ours = [IndexedEvent(idx=120 + i, event=e) for i, e in enumerate(apart)]
    winner = replay(masters)

    def behind(home: Path, was_master: bool) -> list[object]:
        router = Router(me)
        router.master_elected(me)  # commands go out at once, to the queue below
        commands = router.subscribe(Topic.COMMANDS)
        replica = StateReplica(router, home, node_id=me)
        for indexed in masters[:120]:
            replica.append(indexed)
        if was_master:
            replica.start_term()
        for indexed in ours:
            replica.append(indexed)
        replica.master_id = master
        replica.receive(StateSnapshot(snapshot=winner), master)
        assert replica.state == winner
        replica.close()
        return [commands.get_nowait() for _ in range(commands.qsize())]

    asked = behind(tmp_path / "master", was_master=True)
    assert [c.card.model_id for c in asked if isinstance(c, AddCustomModelCard)] == ["acme/minority"]
    assert behind(tmp_path / "follower", was_master=False) == []


def test_a_requests_events_are_written_but_not_fsynced(
    tmp_path: Path, card: ModelCard, monkeypatch: pytest.MonkeyPatch
):
    """Counted at the fsync call (a power cut cannot be made here): a request's task and
    runner-state events are written and flushed without one; a card, an instance or a
    runner's load fsync as before, and every event is read back after reopening."""
    from exo.shared import event_log

    fsyncs: list[int] = []
    real_fsync = event_log.os.fsync
    monkeypatch.setattr(event_log.os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    replica = StateReplica(Router(NodeId("me")), tmp_path / "history")
    instance = two_rank_instance(card, "inst-1", ("ra", "rb"))
    setup: list[Event] = [
        InstanceCreated(instance=instance),
        RunnerStatusUpdated(runner_id=RunnerId("ra"), status=RunnerLoading()),
    ]
    one_request: list[Event] = [
        TaskCreated(task=task("inst-1", "t1")),
        RunnerStatusUpdated(runner_id=RunnerId("ra"), status=RunnerRunning()),
        TaskStatusUpdated(task_id=TaskId("t1"), status=TaskStatus.Running, error_message=None),
        TaskStatusUpdated(task_id=TaskId("t1"), status=TaskStatus.Complete, error_message=None),
        RunnerStatusUpdated(runner_id=RunnerId("ra"), status=RunnerReady()),
        TaskDeleted(task_id=TaskId("t1")),
    ]
    written = [IndexedEvent(idx=i, event=e) for i, e in enumerate(setup + one_request)]
    for indexed in written[:2]:
        replica.append(indexed)
    assert len(fsyncs) == 2
    for indexed in written[2:]:
        replica.append(indexed)
    assert len(fsyncs) == 2
    replica.close()
    reopened = StateReplica(Router(NodeId("me")), tmp_path / "history")
    assert list(reopened.history.since(0)) == written and reopened.state == replay(written)
    reopened.close()


def test_a_node_whose_state_differs_from_the_masters_digest_starts_over(tmp_path: Path, card: ModelCard):
    """Written apart at the same indexes, with the events this node still holds equal to
    the master's (or not held at all): the digest of State the master sends after its
    newest event tells, and so does holding events past it."""
    me, master = NodeId("me"), NodeId("master")
    router = Router(me)
    router.master_elected(me)
    commands = router.subscribe(Topic.COMMANDS)
    masters = random_history(card, 100)
    only_here = card.model_copy(update={"model_id": "acme/only-here"})
    ours = [*masters[:60], IndexedEvent(idx=60, event=CustomModelCardAdded(card=only_here)), *masters[61:]]
    replica = StateReplica(router, tmp_path / "history", node_id=me)
    for indexed in ours:
        replica.append(indexed)
    replica.master_id = master
    truth = replay(masters)

    replica.receive(StateDigest(idx=98, digest=state_digest(replay(masters[:99]))), master)  # behind us
    request = commands.get_nowait()
    assert isinstance(request, RequestEventLog) and request.since_idx == -1
    replica.receive(StateSnapshot(snapshot=truth), master)
    assert replica.state == truth
    while not commands.empty():
        commands.get_nowait()  # the users' writes among what it held, asked for again
    replica.receive(StateDigest(idx=99, digest=state_digest(truth)), master)
    assert commands.empty()  # the same State: nothing to do
    replica.close()

    other = StateReplica(Router(me), tmp_path / "other", node_id=me)
    other.router.master_elected(me)
    asked = other.router.subscribe(Topic.COMMANDS)
    for indexed in ours:
        other.append(indexed)
    other.master_id = master
    other.receive(StateDigest(idx=99, digest=state_digest(truth)), master)  # same index, other State
    request = asked.get_nowait()
    assert isinstance(request, RequestEventLog) and request.since_idx == -1
    other.close()


def test_events_past_the_masters_newest_are_dropped_when_the_state_before_them_is_its(
    tmp_path: Path, card: ModelCard, monkeypatch: pytest.MonkeyPatch
):
    """A dead master's last events, which its successor never got: the node cuts them
    (and asks again for the card among them) instead of starting over."""
    monkeypatch.setattr(replica_module, "SNAPSHOT_EVENTS", 30)
    me, master = NodeId("me"), NodeId("master")
    router = Router(me)
    router.master_elected(me)
    commands = router.subscribe(Topic.COMMANDS)
    masters = random_history(card, 100)
    late_card = card.model_copy(update={"model_id": "acme/late"})
    extra = [IndexedEvent(idx=100, event=CustomModelCardAdded(card=late_card))]
    extra += [IndexedEvent(idx=i, event=NodeGatheredInfo(info=node_info(NODE_B))) for i in range(101, 105)]
    replica = StateReplica(router, tmp_path / "history", node_id=me)
    for indexed in masters + extra:
        replica.append(indexed)
    replica.master_id = master

    replica.receive(StateDigest(idx=99, digest=state_digest(replay(masters))), master)
    assert replica.state == replay(masters) and len(replica.history) == 100
    asked = [commands.get_nowait() for _ in range(commands.qsize())]
    assert [type(c).__name__ for c in asked] == ["AddCustomModelCard"]
    replica.close()
    reopened = StateReplica(Router(me), tmp_path / "history", node_id=me)
    assert reopened.state == replay(masters)
    reopened.close()
