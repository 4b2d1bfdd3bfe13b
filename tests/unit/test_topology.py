"""The topology in State: directed links that change only through apply, and that
survive a trip through JSON in the camelCase the dashboard reads."""

import json

from exo.shared.apply import apply
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    NodeGatheredInfo,
    NodeTimedOut,
    TopologyEdgeDeleted,
    TopologyEdgeUpdated,
)
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.state import State
from exo.shared.types.topology import Connection, NetworkInterface, Topology

A, B, C = "node-a", "node-b", "node-c"


def edge(source: str, sink: str, **measured: float) -> Connection:
    return Connection(source=source, sink=sink, sink_ip=f"10.0.0.{ord(sink[-1]) - ord('a') + 1}", **measured)


def node_info(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        friendly_name=node_id,
        os="Linux",
        backend="cpu",
        cpu_count=2,
        memory=MemoryInfo(total_bytes=16 * 2**30, available_bytes=8 * 2**30),
        disk_available_bytes=100 * 2**30,
        api_port=52415,
        interfaces=[NetworkInterface(name="en0", ip=f"10.0.0.{ord(node_id[-1]) - ord('a') + 1}")],
    )


def apply_all(state: State, *events: Event) -> State:
    for event in events:
        state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))
    return state


def linked_state() -> State:
    """a <-> b and b -> c."""
    return apply_all(
        State(),
        TopologyEdgeUpdated(connection=edge(A, B)),
        TopologyEdgeUpdated(connection=edge(B, A)),
        TopologyEdgeUpdated(connection=edge(B, C)),
    )


# --- the helpers ---------------------------------------------------------------------


def test_links_are_directed():
    topology = linked_state().topology
    assert topology.has_edge(B, C)
    assert not topology.has_edge(C, B)
    assert topology.connection(C, B) is None
    assert topology.connection(B, C) == edge(B, C)


def test_neighbours_are_the_nodes_a_node_reached():
    topology = linked_state().topology
    assert topology.neighbours(B) == [A, C]
    assert topology.neighbours(C) == []


# --- apply ---------------------------------------------------------------------------


def test_edge_updated_inserts_a_new_edge():
    state = apply_all(State(), TopologyEdgeUpdated(connection=edge(A, B, latency_ms=0.3)))
    assert state.topology == Topology(connections=[edge(A, B, latency_ms=0.3)])


def test_edge_updated_replaces_the_edge_with_the_same_direction():
    measured = edge(A, B, latency_ms=0.3, bandwidth_mbps=9400)
    state = apply_all(linked_state(), TopologyEdgeUpdated(connection=measured))

    assert state.topology.connection(A, B) == measured
    assert len(state.topology.connections) == 3
    assert state.topology.connection(B, A) == edge(B, A)


def test_edge_deleted_removes_only_that_direction():
    state = apply_all(linked_state(), TopologyEdgeDeleted(source=A, sink=B))
    assert not state.topology.has_edge(A, B)
    assert state.topology.has_edge(B, A)
    assert state.topology.has_edge(B, C)


def test_deleting_an_unknown_edge_changes_nothing_but_the_index():
    before = linked_state()
    state = apply_all(before, TopologyEdgeDeleted(source=C, sink=A))
    assert state.topology == before.topology


def test_a_timed_out_node_loses_every_edge_to_and_from_it():
    state = apply_all(
        linked_state(),
        NodeGatheredInfo(info=node_info(A)),
        NodeGatheredInfo(info=node_info(C)),
        NodeTimedOut(node_id=A),
    )
    assert state.topology == Topology(connections=[edge(B, C)])
    assert set(state.nodes) == {C}


def test_topology_events_leave_the_input_state_untouched():
    before = linked_state()
    snapshot = before.model_copy(deep=True)
    for event in [
        TopologyEdgeUpdated(connection=edge(A, C)),
        TopologyEdgeUpdated(connection=edge(A, B, latency_ms=1.0)),
        TopologyEdgeDeleted(source=A, sink=B),
        NodeTimedOut(node_id=B),
    ]:
        apply_all(before, event)
        assert before == snapshot, type(event).__name__


# --- JSON ----------------------------------------------------------------------------


def test_topology_events_round_trip_through_json():
    for event in [
        TopologyEdgeUpdated(connection=edge(A, B, latency_ms=0.25, bandwidth_mbps=940.5)),
        TopologyEdgeUpdated(connection=edge(A, C)),
        TopologyEdgeDeleted(source=A, sink=B),
    ]:
        indexed = IndexedEvent(idx=7, event=event)
        assert IndexedEvent.model_validate_json(indexed.model_dump_json()) == indexed


def test_a_state_with_topology_and_interfaces_round_trips_in_camel_case():
    state = apply_all(
        linked_state(),
        TopologyEdgeUpdated(connection=edge(A, B, latency_ms=0.25, bandwidth_mbps=940.5)),
        NodeGatheredInfo(info=node_info(A)),
    )

    wire = json.loads(state.model_dump_json())
    assert wire["topology"]["connections"][0] == {
        "source": A,
        "sink": B,
        "sinkIp": "10.0.0.2",
        "latencyMs": 0.25,
        "bandwidthMbps": 940.5,
    }
    assert wire["nodes"][A]["interfaces"] == [{"name": "en0", "ip": "10.0.0.1"}]
    assert State.model_validate_json(state.model_dump_json()) == state


def test_node_info_without_interfaces_still_validates():
    wire = json.loads(node_info(A).model_dump_json())
    del wire["interfaces"]
    assert NodeInfo.model_validate(wire).interfaces == []
