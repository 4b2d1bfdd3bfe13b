"""Messages for the master over a real zenoh transport between two routers on loopback:
a node that learns of an election before the winner has taken office holds what it
sends for the master until it hears from it (a restarted worker's first status report
was lost this way)."""

import asyncio
import uuid

from exo.routing.router import Router, Topic
from exo.routing.zenoh_transport import ZenohTransport
from exo.shared.types.common import NodeId, RunnerId
from exo.shared.types.election import Heartbeat
from exo.shared.types.events import IndexedEvent, MasterElected, RunnerStatusUpdated
from exo.shared.types.runners import RunnerShutdown
from tests.support.node import free_port

REPORT = RunnerStatusUpdated(runner_id=RunnerId("r1"), status=RunnerShutdown())


def routers() -> tuple[Router, Router]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    master = Router(NodeId("b"), ZenohTransport(namespace, listen_port=port, multicast=False))
    worker = Router(NodeId("a"), ZenohTransport(namespace, bootstrap_peers=[f"tcp/127.0.0.1:{port}"], multicast=False))
    return master, worker


async def until_connected(sender: Router, receiver: Router) -> None:
    """Heartbeats are never held: ping until one gets through."""
    heard = receiver.subscribe(Topic.ELECTION)
    ping = Heartbeat(node_id=sender.node_id, session_id="s", started_at=0.0, commands_seen=0, force_master=False)
    for _ in range(100):
        sender.publish(Topic.ELECTION, ping)
        try:
            await asyncio.wait_for(heard.get(), timeout=0.1)
            return
        except TimeoutError:
            continue
    raise AssertionError("the two routers never connected")


def test_reports_wait_for_the_elected_master_to_be_heard():
    async def scenario() -> None:
        master, worker = routers()
        master.start()
        worker.start()
        heard_again: list[str] = []
        worker.on_master_heard(lambda: heard_again.append("released"))
        try:
            await until_connected(worker, master)
            worker.master_elected(NodeId("b"))
            worker.publish(Topic.LOCAL_EVENTS, REPORT)
            await asyncio.sleep(0.5)
            # Only now does "b" take office: it subscribes, then announces itself.
            inbox = master.subscribe(Topic.LOCAL_EVENTS)
            master.master_elected(NodeId("b"))
            assert heard_again == []
            master.publish(Topic.GLOBAL_EVENTS, IndexedEvent(idx=0, event=MasterElected(node_id=NodeId("b"))))
            assert await asyncio.wait_for(inbox.get(), timeout=10) == REPORT
            assert heard_again == ["released"]
            # From then on, reports go at once.
            worker.publish(Topic.LOCAL_EVENTS, REPORT)
            assert await asyncio.wait_for(inbox.get(), timeout=10) == REPORT
        finally:
            master.close()
            worker.close()

    asyncio.run(scenario())


def test_a_node_elected_itself_sends_at_once():
    async def scenario() -> None:
        router = Router(NodeId("a"))
        router.start()
        inbox = router.subscribe(Topic.LOCAL_EVENTS)
        router.publish(Topic.LOCAL_EVENTS, REPORT)
        assert inbox.empty()  # no master yet: held
        router.master_elected(NodeId("a"))
        assert inbox.get_nowait() == REPORT

    asyncio.run(scenario())


def test_reports_go_once_the_elected_masters_heartbeat_names_itself():
    """A node names itself in its heartbeat only once its master listens: a quiet
    master's heartbeat comes sooner than its next event."""

    async def scenario() -> None:
        master, worker = routers()
        master.start()
        worker.start()
        try:
            await until_connected(master, worker)
            worker.master_elected(NodeId("b"))
            worker.publish(Topic.LOCAL_EVENTS, REPORT)
            inbox = master.subscribe(Topic.LOCAL_EVENTS)
            # Heard, but not yet naming itself: still held.
            await until_connected(master, worker)
            await asyncio.sleep(0.3)
            assert inbox.empty()
            master.publish(
                Topic.ELECTION,
                Heartbeat(node_id=NodeId("b"), session_id="s", started_at=0.0, commands_seen=0, master_id=NodeId("b")),
            )
            assert await asyncio.wait_for(inbox.get(), timeout=10) == REPORT
        finally:
            master.close()
            worker.close()

    asyncio.run(scenario())
