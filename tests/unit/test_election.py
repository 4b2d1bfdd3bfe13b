from exo.routing.election import choose_master
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
