import asyncio
import time

from exo.routing.election import Election, choose_master, master_to_follow
from exo.routing.router import Router, Topic
from exo.shared.types.common import NodeId
from exo.shared.types.election import Heartbeat


def candidate(node_id: str, **overrides) -> Heartbeat:
    fields = {"session_id": f"session-{node_id}", "started_at": 1000.0, "commands_seen": 10, "force_master": False}
    return Heartbeat(node_id=NodeId(node_id), **(fields | overrides))


def test_single_candidate_elects_itself():
    assert choose_master([candidate("only")]) == "only"


def test_force_master_beats_everything():
    forced = candidate("a", force_master=True, started_at=5000.0, commands_seen=0)
    veteran = candidate("z", started_at=1.0, commands_seen=9999)
    assert choose_master([veteran, forced]) == "a"


def test_the_node_that_started_first_wins():
    assert (
        choose_master([candidate("a", started_at=2000.0, commands_seen=99), candidate("b", started_at=1500.0)]) == "b"
    )


def test_commands_seen_breaks_a_seniority_tie():
    assert choose_master([candidate("a", commands_seen=11), candidate("b", commands_seen=10)]) == "a"


def test_node_id_breaks_a_full_tie():
    assert choose_master([candidate("a"), candidate("c"), candidate("b")]) == "c"


def test_order_of_candidates_does_not_matter():
    candidates = [candidate("a", started_at=3.0), candidate("b", started_at=2.0), candidate("c", started_at=2.0)]
    assert choose_master(candidates) == choose_master(list(reversed(candidates))) == "c"


def test_a_joining_node_follows_the_master_that_names_itself_and_wins():
    own = candidate("new", started_at=9000.0)
    master = candidate("m", started_at=1000.0, master_id=NodeId("m"))
    follower = candidate("f", started_at=2000.0, master_id=NodeId("m"))
    assert master_to_follow(own, master, [master, follower]) == "m"


def test_a_joining_node_does_not_follow_a_peer_that_only_follows_a_master():
    own = candidate("new", started_at=9000.0)
    follower = candidate("f", started_at=2000.0, master_id=NodeId("m"))
    assert master_to_follow(own, follower, [follower]) is None


def test_a_joining_node_does_not_follow_a_master_another_candidate_beats():
    """Another node more senior than the master heard (a heal, say): the round decides."""
    own = candidate("new", started_at=9000.0)
    master = candidate("m", started_at=1000.0, master_id=NodeId("m"))
    senior = candidate("s", started_at=500.0, master_id=NodeId("s2"))
    assert master_to_follow(own, master, [master, senior]) is None
    forced = candidate("new", started_at=9000.0, force_master=True)
    assert master_to_follow(forced, master, [master]) is None


def test_a_master_back_as_a_new_process_within_the_peer_timeout_is_replaced():
    """It comes back younger than the others and with no master running: the others
    must hold a round, not go on following it."""

    async def scenario() -> list[NodeId]:
        router = Router(NodeId("me"))
        router.start()
        elected: list[NodeId] = []

        async def on_elected(master_id: NodeId) -> None:
            elected.append(master_id)

        election = Election(NodeId("me"), "session-me", router, on_elected)
        running = asyncio.create_task(election.run())
        old = candidate("a", session_id="a-1", started_at=1.0)
        new = candidate("a", session_id="a-2", started_at=time.time() + 100)
        try:
            for heartbeat in [old] * 6 + [new] * 6:
                router.publish(Topic.ELECTION, heartbeat)
                await asyncio.sleep(0.5)
        finally:
            running.cancel()
        return elected

    assert asyncio.run(scenario()) == ["a", "me"]
