"""Master election: every node ranks the same candidates the same way."""

from exo.routing.election import Candidate, choose_master
from exo.shared.types.common import NodeId


def candidate(node_id: str, **overrides) -> Candidate:
    fields = {
        "clock": 5,
        "seniority": 100.0,
        "commands_seen": 10,
        "force_master": False,
    }
    return Candidate(node_id=NodeId(node_id), **(fields | overrides))


def test_a_single_candidate_elects_itself():
    assert choose_master([candidate("alone")]) == "alone"


def test_force_master_wins_over_everything_else():
    forced = candidate("a", force_master=True, clock=0, seniority=0.0, commands_seen=0)
    veteran = candidate("z", clock=99, seniority=9999.0, commands_seen=9999)
    assert choose_master([veteran, forced]) == "a"


def test_higher_clock_wins_over_seniority():
    assert choose_master([candidate("a", clock=6, seniority=1.0), candidate("b", seniority=500.0)]) == "a"


def test_seniority_wins_over_commands_seen():
    assert choose_master([candidate("a", seniority=101.0), candidate("b", commands_seen=500)]) == "a"


def test_commands_seen_win_over_node_id():
    assert choose_master([candidate("a", commands_seen=11), candidate("z")]) == "a"


def test_node_id_breaks_a_full_tie():
    assert choose_master([candidate("node-a"), candidate("node-b")]) == "node-b"


def test_the_order_candidates_arrive_in_does_not_matter():
    candidates = [
        candidate("a", seniority=3.0),
        candidate("b", clock=7),
        candidate("c", commands_seen=50),
    ]
    assert {choose_master(candidates), choose_master(candidates[::-1])} == {"b"}
