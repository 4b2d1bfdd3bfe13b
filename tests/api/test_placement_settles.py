"""A placement sent while the cluster is still settling: this node answers HTTP before its
own worker is in State, and the links to a node that just joined take a few seconds to
be measured. POST /place_instance waits for that (a few seconds) instead of failing, and
when the links never come, says in words that they are being measured and when to retry.

The first test runs a real node; the others drive the app in process against the fake
cluster port (tests/support/fake_cluster.py), which lets them hold back the node's
registration and the link measurements a real node makes on its own."""

import asyncio
import time
from pathlib import Path

import httpx

from exo.api.app import create_app
from exo.catalog.cards import builtin_cards
from exo.shared.types.common import NodeId
from exo.shared.types.events import NodeGatheredInfo, TopologyEdgeUpdated
from exo.shared.types.state import State
from exo.shared.types.topology import Connection
from tests.support.fake_cluster import FakeCluster, node_info
from tests.support.node import TINY_MODEL_ID, start_node, stop_node

MODEL = "mlx-community/Qwen3.5-2B-MLX-8bit"


def test_a_placement_right_after_node_id_answers_is_placed(tmp_path: Path, tiny_models_dir: Path) -> None:
    # start_node returns as soon as GET /node_id answers; nothing waits for State here.
    node = start_node(tmp_path / "home", {"EXO_MODELS_DIRS": str(tiny_models_dir)})
    try:
        response = node.post("/place_instance", json={"model_id": TINY_MODEL_ID})
        assert response.status_code == 200, response.text
    finally:
        stop_node(node)


async def place(cluster: FakeCluster, body: dict, settle: list[tuple[float, object]]) -> tuple[httpx.Response, float]:
    """POSTs /place_instance while the events of `settle` arrive, each after its delay."""

    async def arrive() -> None:
        for delay, event in settle:
            await asyncio.sleep(delay)
            cluster.emit(event)  # type: ignore[arg-type]

    arriving = asyncio.create_task(arrive())
    transport = httpx.ASGITransport(app=create_app(cluster))
    async with httpx.AsyncClient(transport=transport, base_url="http://exo", timeout=30) as client:
        started = time.monotonic()
        response = await client.post("/place_instance", json=body)
    await arriving
    return response, time.monotonic() - started


def test_placement_waits_for_this_nodes_own_registration() -> None:
    cluster = FakeCluster({MODEL: builtin_cards()[MODEL]})
    # The node serves HTTP; its worker is not in State yet.
    cluster.state, cluster.history = State(), []
    response, _ = asyncio.run(place(cluster, {"model_id": MODEL}, [(0.3, NodeGatheredInfo(info=node_info("node-a")))]))
    assert response.status_code == 200, response.text


def link(source: str, sink: str) -> TopologyEdgeUpdated:
    return TopologyEdgeUpdated(connection=Connection(source=NodeId(source), sink=NodeId(sink), sink_ip="10.0.0.1"))


def test_a_multi_node_placement_waits_for_the_links_to_be_measured() -> None:
    cluster = FakeCluster({MODEL: builtin_cards()[MODEL]}, nodes=("node-a", "node-b"))
    body = {"model_id": MODEL, "min_nodes": 2}
    response, _ = asyncio.run(place(cluster, body, [(0.3, link("node-a", "node-b")), (0.3, link("node-b", "node-a"))]))
    assert response.status_code == 200, response.text


def test_links_that_stay_unmeasured_are_explained_in_words() -> None:
    cluster = FakeCluster({MODEL: builtin_cards()[MODEL]}, nodes=("node-a", "node-b"))
    response, seconds = asyncio.run(place(cluster, {"model_id": MODEL, "min_nodes": 2}, []))
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "no link between node-a and node-b" in message
    assert "still being measured" in message and "retry in 5 s" in message
    # It waited for the measurement before answering, but not much longer.
    assert 5 < seconds < 10
