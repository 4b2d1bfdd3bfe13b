"""The download-control endpoints in process, against a fake cluster port
(tests/support/fake_cluster.py): which command each sends, to which node, and the 4xx
for what it refuses. The master and worker side runs in tests/node/test_download_control.py
and tests/cluster/test_shard_downloads.py with real processes."""

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from exo.api.app import create_app
from exo.catalog.cards import builtin_cards
from exo.master.placement import place_instance
from exo.shared.types.commands import CancelDownload, CreateInstance, DeleteDownload, StartDownload
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.downloads import DownloadCompleted, DownloadOngoing, DownloadProgress
from exo.shared.types.events import NodeDownloadProgress
from tests.support.fake_cluster import FakeCluster

MODEL = "mlx-community/Qwen3.5-2B-MLX-8bit"
N_LAYERS = builtin_cards()[MODEL].n_layers


def run(test: Callable[[FakeCluster, httpx.AsyncClient], Awaitable[None]]) -> FakeCluster:
    async def main() -> FakeCluster:
        cluster = FakeCluster({MODEL: builtin_cards()[MODEL]}, nodes=("node-a", "node-b"))
        transport = httpx.ASGITransport(app=create_app(cluster))
        async with httpx.AsyncClient(transport=transport, base_url="http://exo") as client:
            await test(cluster, client)
        return cluster

    return asyncio.run(main())


def record(cluster: FakeCluster, node: str, progress: DownloadProgress) -> None:
    cluster.emit(NodeDownloadProgress(node_id=NodeId(node), model_id=ModelId(MODEL), progress=progress))


def test_each_endpoint_sends_its_command_for_the_node_asked_or_this_one():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        assert (await client.post("/download/start", json={"model_id": MODEL})).status_code == 200
        started = await client.post("/download/start", json={"model_id": MODEL, "node_id": "node-b"})
        assert started.json()["node_id"] == "node-b" and started.json()["command_id"]
        record(cluster, "node-b", DownloadOngoing(downloaded_bytes=1, total_bytes=9))
        assert (await client.post("/download/cancel", json={"model_id": MODEL, "node_id": "node-b"})).status_code == 200
        assert (await client.delete(f"/download/node-b/{MODEL}")).status_code == 200
        # Upstream exo's shapes: a shard's metadata naming the model, camelCase node id.
        shard = {"modelCard": {"modelId": MODEL}, "startLayer": 4, "endLayer": 8, "nLayers": N_LAYERS}
        upstream = {"targetNodeId": "node-b", "shardMetadata": shard}
        assert (await client.post("/download/start", json=upstream)).status_code == 200
        record(cluster, "node-b", DownloadOngoing(downloaded_bytes=1, total_bytes=9))
        cancel = {"targetNodeId": "node-b", "modelId": MODEL}
        assert (await client.post("/download/cancel", json=cancel)).status_code == 200
        no_model = {"targetNodeId": "node-b", "shardMetadata": {"startLayer": 0}}
        assert (await client.post("/download/start", json=no_model)).status_code in (400, 422)

    cluster = run(test)
    assert [(type(c), c.node_id, c.model_id) for c in cluster.commands] == [
        (StartDownload, "node-a", MODEL),
        (StartDownload, "node-b", MODEL),
        (CancelDownload, "node-b", MODEL),
        (DeleteDownload, "node-b", MODEL),
        (StartDownload, "node-b", MODEL),
        (CancelDownload, "node-b", MODEL),
    ]
    assert [c.layers for c in cluster.commands if isinstance(c, StartDownload)] == [None, None, (4, 8)]


def test_layers_are_checked_against_the_card_and_all_of_them_mean_the_whole_model():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        for layers in ([0, N_LAYERS + 1], [3, 3], [-1, 2]):
            refused = await client.post("/download/start", json={"model_id": MODEL, "layers": layers})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_layers", layers
        assert (await client.post("/download/start", json={"model_id": MODEL, "layers": [0, N_LAYERS]})).is_success
        assert (await client.post("/download/start", json={"model_id": MODEL, "layers": [2, 5]})).is_success

    cluster = run(test)
    assert [c.layers for c in cluster.commands if isinstance(c, StartDownload)] == [None, (2, 5)]


def test_refusals_are_4xx_with_a_code_and_send_nothing():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        async def code(response: Awaitable[httpx.Response]) -> tuple[int, str]:
            answered = await response
            return answered.status_code, answered.json()["error"]["code"]

        assert await code(client.post("/download/start", json={"model_id": "no/such"})) == (404, "model_not_found")
        nobody = {"model_id": MODEL, "node_id": "node-z"}
        assert await code(client.post("/download/start", json=nobody)) == (404, "node_not_found")
        assert await code(client.post("/download/cancel", json=nobody)) == (404, "node_not_found")
        assert await code(client.delete(f"/download/node-z/{MODEL}")) == (404, "node_not_found")
        assert await code(client.delete("/download/node-a/no/such")) == (404, "model_not_found")
        assert await code(client.delete(f"/download/node-a/{MODEL}")) == (404, "download_not_found")
        idle = {"model_id": MODEL}
        assert await code(client.post("/download/cancel", json=idle)) == (409, "download_not_running")
        assert (await client.post("/download/start", json={"model_id": MODEL, "extra": 1})).status_code in (400, 422)

        record(cluster, "node-a", DownloadCompleted(total_bytes=1, path="/ro/m", read_only=True))
        assert await code(client.delete(f"/download/node-a/{MODEL}")) == (409, "read_only_model_dir")
        record(cluster, "node-a", DownloadOngoing(downloaded_bytes=1, total_bytes=9))
        cluster.send_command(CreateInstance(instance=place_instance(cluster.state, builtin_cards()[MODEL])))
        using = next(iter(cluster.state.instances.values())).shard_assignments.node_to_runner
        node = next(iter(using))
        assert await code(client.post("/download/cancel", json={"model_id": MODEL, "node_id": node})) == (
            409,
            "model_in_use",
        )
        record(cluster, node, DownloadCompleted(total_bytes=1, path="/m"))
        assert await code(client.delete(f"/download/{node}/{MODEL}")) == (409, "model_in_use")

    cluster = run(test)
    assert not any(isinstance(c, StartDownload | CancelDownload | DeleteDownload) for c in cluster.commands)
