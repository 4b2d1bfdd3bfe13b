"""A real node measures its speed once after it starts (worker/speed_probe.py) and the
cluster's State carries it (NodeInfo.speed), where placement reads it."""

from tests.support.node import ExoNode


def test_a_node_reports_its_measured_speed(exo_node: ExoNode):
    node_id = exo_node.node_id()
    assert exo_node.state()["nodes"].get(node_id, {}).get("speed") is None  # not before the probe's delay
    state = exo_node.wait_for_state(
        lambda s: s["nodes"].get(node_id, {}).get("speed") is not None, timeout=90, what="the node's speed"
    )
    speed = state["nodes"][node_id]["speed"]
    print(f"measured: {speed}")
    assert speed["matmulGflops"] > speed["matvecGbps"] > 0
    assert "cpu" in speed["device"]
