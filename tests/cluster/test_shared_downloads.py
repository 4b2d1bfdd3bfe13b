"""Nodes that need the same files share one hub download: the node State names
(shared/queries.py's hub_fetcher: the lowest id among the nodes needing a file) takes
each file from the fake hub (tests/support/fake_hub.py, throttled so the downloads
overlap), and the other streams it from that node's /peer-hub while it arrives. Both
copies are checked against the hub's sha256. A kill -9 of the fetching node mid-file
loses nothing: the other resumes the file from the hub with Range. A node waits for the
fetching node to begin its file however long that takes. With a cluster secret,
/peer-hub wants the token derived from it."""

import hashlib
import signal
import time
import uuid
from pathlib import Path

import httpx

from exo.routing.seal import peer_token
from exo.shared.models.weight_files import files_for_layers
from tests.cluster.test_shard_downloads import (
    MODEL_ID,
    N_LAYERS,
    answers,
    cluster_with_the_model,
    hub_file,
    make_layered_model,
    peer_speed,
    place_ready,
)
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)

MB = 1 << 20


def hub_hashes(repo: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in repo.iterdir()}


def by_role(nodes) -> tuple:
    """(the node that takes the files from the hub, the one that takes them from it)."""
    fetcher = min(nodes, key=lambda node: node.node_id())
    return fetcher, next(node for node in nodes if node is not fetcher)


def model_files(node) -> dict[str, str]:
    """sha256 of each file in the node's model dir."""
    (model_dir,) = [d for d in (node.home / "models").iterdir() if d.name == "acme--layered"]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in model_dir.iterdir()}


def test_a_two_node_tensor_instance_takes_the_model_from_the_hub_once(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_layered_model(root / "acme--layered", num_key_value_heads=6)
    hashes = hub_hashes(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    with cluster_with_the_model(2, endpoint, tmp_path) as nodes:
        fetcher, other = by_role(nodes)
        fake_hub.throttle_bytes_per_second = 4 * MB
        started = time.monotonic()
        place_ready(nodes, min_nodes=2, sharding="Tensor")
        took = time.monotonic() - started
        fake_hub.throttle_bytes_per_second = None
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"2-node tensor, shared download: hub bytes / model size = {ratio:.3f} ({took:.1f} s to ready)")
        for node in nodes:
            assert model_files(node) == hashes
        assert f"of {MODEL_ID} from peer http://127.0.0.1:{fetcher.api_port}" in other.logs()
        assert "from peer" not in fetcher.logs()
        print(f"peer transfer on loopback: {peer_speed(fetcher) / 1e6:.0f} MB/s")
        assert ratio < 1.1, ratio
        assert answers(other)


def completed(node_id: str):
    return lambda s: s["downloads"].get(node_id, {}).get(MODEL_ID, {}).get("kind") == "DownloadCompleted"


def both_download(nodes) -> None:
    """POST /download/start of the whole model for each node, through the last one's API."""
    for node in nodes:
        response = nodes[-1].post("/download/start", json={"model_id": MODEL_ID, "node_id": node.node_id()})
        assert response.status_code == 200, response.text


def test_the_fetching_node_killed_mid_file_loses_nothing(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_layered_model(root / "acme--layered")
    hashes = hub_hashes(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    with cluster_with_the_model(2, endpoint, tmp_path) as nodes:
        fetcher, other = by_role(nodes)
        fetcher_id, other_id = fetcher.node_id(), other.node_id()
        fake_hub.throttle_bytes_per_second = 1.5 * MB
        both_download([fetcher, other])

        def fetched(share: float):
            def condition(s: dict) -> bool:
                record = s["downloads"].get(fetcher_id, {}).get(MODEL_ID, {})
                return record.get("kind") == "DownloadOngoing" and record["downloadedBytes"] > share * model_bytes

            return condition

        other.wait_for_state(fetched(0.45), timeout=60, what="the fetcher half way")
        fetcher.process.send_signal(signal.SIGKILL)
        fetcher.process.wait()
        killed_at = fake_hub.body_bytes_sent

        done = other.wait_for_state(completed(other_id), timeout=120, what="the other node's download")
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(
            f"fetcher killed when the hub had sent {killed_at / model_bytes:.0%} of the model: hub bytes / model = {ratio:.3f}"
        )
        assert done["downloads"][other_id][MODEL_ID]["layers"] is None
        assert model_files(other) == hashes
        assert f"of {MODEL_ID} from peer http://127.0.0.1:{fetcher.api_port}" in other.logs()
        assert f"peer http://127.0.0.1:{fetcher.api_port}/peer-hub could not give" in other.logs()
        assert ratio < 1.2, ratio


def test_with_a_cluster_secret_the_peer_hub_wants_its_token(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_layered_model(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    secret = uuid.uuid4().hex
    with cluster_with_the_model(2, endpoint, tmp_path, args=("--cluster-secret", secret)) as nodes:
        fetcher, other = by_role(nodes)
        fake_hub.throttle_bytes_per_second = 4 * MB
        both_download([fetcher, other])
        for node in nodes:
            node.wait_for_state(completed(node.node_id()), timeout=60, what="downloads")
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"2 nodes with a cluster secret, shared download: hub bytes / model = {ratio:.3f}")
        assert f"of {MODEL_ID} from peer http://127.0.0.1:{fetcher.api_port}" in other.logs()
        assert ratio < 1.1, ratio
        listing = f"{fetcher.url}/peer-hub/api/models/{MODEL_ID}/revision/main"
        assert httpx.get(listing).status_code == 401
        assert httpx.get(listing, headers={"Authorization": "Bearer wrong"}).status_code == 401
        with_token = httpx.get(listing, headers={"Authorization": f"Bearer {peer_token(secret)}"})
        assert with_token.status_code == 200 and with_token.json()["siblings"], with_token.text
        assert httpx.get(f"{fetcher.url}/v1/models").status_code == 200  # no --api-key: the rest stays open


def test_nodes_wait_for_the_fetching_node_to_begin_their_file_however_long_it_takes(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    """The usual 3-file hub layout; the lowest node downloads the whole model, the other two
    the first and the last layers' files (ranks 0 and 2 of a pipeline), all at once. The
    lowest takes every file from the hub for all, the middle one first, and that one comes
    slowly: longer than a peer hub waits for a file to begin arriving (20 s). The others
    ask again until their files arrive there, rather than take them from the hub too."""
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered", file_of=hub_file)
    middle = sorted(set(weight_map.values()))[1]
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    with cluster_with_the_model(3, endpoint, tmp_path) as nodes:
        fetcher, *others = sorted(nodes, key=lambda node: node.node_id())
        fake_hub.throttle_files = {middle: (root / "acme--layered" / middle).stat().st_size / 24}
        ranges = [(fetcher, None), (others[0], [0, 2]), (others[1], [N_LAYERS - 2, N_LAYERS])]
        for node, layers in ranges:
            body = {"model_id": MODEL_ID, "node_id": node.node_id(), "layers": layers}
            assert nodes[0].post("/download/start", json=body).status_code == 200
        for node in nodes:
            node.wait_for_state(completed(node.node_id()), timeout=120, what="downloads")
        fake_hub.throttle_files = {}
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"3-file layout, the middle file slow at the fetching node: hub bytes / model = {ratio:.3f}")
        for node, layers in ranges:
            held = {f.name for f in (node.home / "models").rglob("*.safetensors")}
            assert held == files_for_layers(weight_map, None if layers is None else tuple(layers)), held
        assert ratio <= 1.1, ratio
        for node in others:
            assert "has not begun arriving at peer" in node.logs()
            assert f"of {MODEL_ID} from peer http://127.0.0.1:{fetcher.api_port}" in node.logs()
