"""Download control through a real node and the fake hub (tests/support/fake_hub.py):
POST /download/start with no instance, progress with speed and ETA in /state and on the
node's console, POST /download/cancel keeping the verified bytes, a resume, DELETE
/download/{node}/{model}, the 4xx answers, and GET /models/search online and offline."""

import json
import shutil
import signal
import subprocess
import time
from importlib.resources import files
from pathlib import Path

from exo.devtools.tiny_models import make_tiny_llama
from exo.shared.models.weight_files import files_for_layers
from tests.cluster.test_shard_downloads import make_layered_model
from tests.node.test_download import BIG_SHARD, MB, dir_bytes, make_sharded_model
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)
from tests.support.node import ExoNode, start_node, stop_node

SHARDED = "acme/sharded"
TINY = "acme/tiny-hub"
LAYERED = "acme/layered"


def record(node: ExoNode, node_id: str, model_id: str) -> dict | None:
    return node.state()["downloads"].get(node_id, {}).get(model_id)


def wait_record(node: ExoNode, node_id: str, model_id: str, condition, what: str) -> dict:
    state = node.wait_for_state(
        lambda s: condition(s["downloads"].get(node_id, {}).get(model_id)), timeout=60, what=what
    )
    return state["downloads"][node_id][model_id]


def dashboard_rows(state: dict) -> list[dict]:
    """What the dashboard's download list shows for this State (view.mjs run in Node)."""
    view = Path(str(files("exo") / "resources" / "dashboard" / "view.mjs"))
    script = (
        f"const view = await import({json.dumps(view.as_uri())});"
        "let input = ''; for await (const chunk of process.stdin) input += chunk;"
        "console.log(JSON.stringify(view.downloadRows(JSON.parse(input))));"
    )
    shown = subprocess.run(
        ["node", "--input-type=module", "-e", script], input=json.dumps(state), capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def error_code(response) -> str:
    return response.json()["error"]["code"]


def test_start_cancel_resume_and_delete_a_download(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=24 * MB)
    make_tiny_llama(root / "acme--tiny-hub")
    model_bytes = sum(len(b) for name, b in dir_bytes(root / "acme--sharded").items() if "consolidated" not in name)
    home = tmp_path / "home"
    node = start_node(home, {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        node_id = node.node_id()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        for model_id in (SHARDED, TINY):
            assert node.post("/models/add", json={"model_id": model_id}).status_code == 200

        # Unknown models and nodes, and nothing to cancel or delete yet: clear 4xx.
        unknown_model = node.post("/download/start", json={"model_id": "acme/nope"})
        assert unknown_model.status_code == 404 and error_code(unknown_model) == "model_not_found"
        unknown_node = node.post("/download/start", json={"model_id": SHARDED, "node_id": "no-such-node"})
        assert unknown_node.status_code == 404 and error_code(unknown_node) == "node_not_found"
        idle = node.post("/download/cancel", json={"model_id": SHARDED})
        assert idle.status_code == 409 and error_code(idle) == "download_not_running", idle.text
        nothing = node.delete(f"/download/{node_id}/{SHARDED}")
        assert nothing.status_code == 404 and error_code(nothing) == "download_not_found", nothing.text
        assert node.delete(f"/download/no-such-node/{SHARDED}").status_code == 404
        assert node.delete(f"/download/{node_id}/acme/nope").status_code == 404

        # Start with no instance: progress with bytes, speed and ETA, and a console line.
        fake_hub.throttle_bytes_per_second = 4 * MB
        started = node.post("/download/start", json={"model_id": SHARDED, "target_node_id": node_id})
        assert started.status_code == 200, started.text
        ongoing = wait_record(
            node,
            node_id,
            SHARDED,
            lambda r: (
                r and r["kind"] == "DownloadOngoing" and r["bytesPerSecond"] > 0 and r["downloadedBytes"] > 4 * MB
            ),
            "download under way",
        )
        assert ongoing["etaSeconds"] is not None and 0 < ongoing["etaSeconds"] < 60, ongoing
        [row] = dashboard_rows(node.state())
        assert row["modelId"] == SHARDED and row["text"].endswith(" s left") and 0 < row["fraction"] < 1, row
        assert ongoing["totalBytes"] == model_bytes
        assert node.state()["instances"] == {}
        deadline = time.monotonic() + 10
        while f"downloading {SHARDED}: [" not in node.logs():
            assert time.monotonic() < deadline, node.logs()[-3000:]
            time.sleep(0.2)
        print(next(line for line in node.logs().splitlines() if f"downloading {SHARDED}: [" in line))

        # Cancel: the record says so, the verified bytes stay, nothing more is fetched.
        cancelled = node.post("/download/cancel", json={"model_id": SHARDED})
        assert cancelled.status_code == 200, cancelled.text
        kept = wait_record(node, node_id, SHARDED, lambda r: r and r["kind"] == "DownloadCancelled", "cancelled")
        assert kept["downloadedBytes"] > 4 * MB, kept
        [row] = dashboard_rows(node.state())
        assert row["text"].startswith("cancelled, ") and row["text"].endswith(" kept"), row
        (partial,) = home.rglob(f"{BIG_SHARD}.partial")
        held = partial.stat().st_size
        assert held > 2 * MB
        sent = fake_hub.body_bytes_sent
        time.sleep(1.5)
        assert fake_hub.body_bytes_sent - sent < 128 * 1024, "the hub kept sending after the cancel"
        assert partial.stat().st_size == held

        # Start again: it resumes from the kept bytes.
        fake_hub.throttle_bytes_per_second = None
        assert node.post("/download/start", json={"model_id": SHARDED}).status_code == 200
        done = wait_record(node, node_id, SHARDED, lambda r: r and r["kind"] == "DownloadCompleted", "completed")
        model_dir = home / "models" / "acme--sharded"
        assert done["path"] == str(model_dir)
        assert (model_dir / BIG_SHARD).read_bytes() == (root / "acme--sharded" / BIG_SHARD).read_bytes()
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(
            f"start, cancel at {kept['downloadedBytes'] / model_bytes:.0%}, start again: hub bytes / model = {ratio:.3f}"
        )
        assert ratio < 1.2, ratio

        # Delete: the files and the record go.
        deleted = node.delete(f"/download/{node_id}/{SHARDED}")
        assert deleted.status_code == 200, deleted.text
        node.wait_for_state(lambda s: SHARDED not in s["downloads"].get(node_id, {}), what="record deleted")
        assert not model_dir.exists() and not list(home.rglob("acme--sharded*"))
        assert node.state()["downloadOrders"] == {node_id: {}}

        # Deleting a running download stops it and leaves no partial files.
        fake_hub.throttle_bytes_per_second = 4 * MB
        assert node.post("/download/start", json={"model_id": SHARDED}).status_code == 200
        wait_record(
            node, node_id, SHARDED, lambda r: r and r["kind"] == "DownloadOngoing" and r["downloadedBytes"] > 0, "again"
        )
        assert node.delete(f"/download/{node_id}/{SHARDED}").status_code == 200
        node.wait_for_state(lambda s: SHARDED not in s["downloads"].get(node_id, {}), what="running download deleted")
        sent = fake_hub.body_bytes_sent
        time.sleep(1)
        assert fake_hub.body_bytes_sent - sent < 128 * 1024, "the hub kept sending after the deletion"
        assert not list(home.rglob("acme--sharded*")) and not list(home.rglob("*.partial"))
        fake_hub.throttle_bytes_per_second = None

        # A model a running instance uses is neither cancelled nor deleted.
        node.place(TINY, timeout=120)
        in_use = node.delete(f"/download/{node_id}/{TINY}")
        assert in_use.status_code == 409 and error_code(in_use) == "model_in_use", in_use.text
        assert "delete the instance first" in in_use.json()["error"]["message"]
        assert (home / "models" / "acme--tiny-hub" / "model.safetensors").is_file()
    finally:
        stop_node(node)
        shutil.rmtree(home, ignore_errors=True)


def test_model_search_proxies_the_hub_and_says_when_it_cannot(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    for name in ("acme--tiny-hub", "acme--other", "zeta--tiny-two"):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    node = start_node(tmp_path / "online", env)
    offline = start_node(tmp_path / "offline", {**env, "EXO_OFFLINE": "1"})
    try:
        found = node.get("/models/search", params={"q": "TINY"})
        assert found.status_code == 200, found.text
        assert [model["id"] for model in found.json()] == ["acme/tiny-hub", "zeta/tiny-two"]
        assert found.json()[0]["author"] == "acme" and found.json()[0]["known"] is False
        assert [m["id"] for m in node.get("/models/search", params={"query": "other"}).json()] == ["acme/other"]
        assert len(node.get("/models/search", params={"limit": 2}).json()) == 2

        requests = len(fake_hub.requests)
        refused = offline.get("/models/search", params={"q": "tiny"})
        assert refused.status_code == 503 and error_code(refused) == "offline", refused.text
        assert "offline" in refused.json()["error"]["message"]
        assert len(fake_hub.requests) == requests

        fake_hub.stop()
        unreachable = node.get("/models/search", params={"q": "tiny"})
        assert unreachable.status_code == 503 and error_code(unreachable) == "hub_unreachable", unreachable.text
        assert "cannot search the hub: could not reach" in unreachable.json()["error"]["message"]
    finally:
        stop_node(node)
        stop_node(offline)


def test_a_started_download_resumes_by_itself_after_the_node_is_killed(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=24 * MB)
    model_bytes = sum(len(b) for name, b in dir_bytes(root / "acme--sharded").items() if "consolidated" not in name)
    home = tmp_path / "home"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    node = start_node(home, env)
    try:
        node_id = node.node_id()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        assert node.post("/models/add", json={"model_id": SHARDED}).status_code == 200
        fake_hub.throttle_bytes_per_second = 8 * MB
        assert node.post("/download/start", json={"model_id": SHARDED}).status_code == 200
        wait_record(
            node,
            node_id,
            SHARDED,
            lambda r: r and r["kind"] == "DownloadOngoing" and r["downloadedBytes"] > 8 * MB,
            "half",
        )
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
        fake_hub.throttle_bytes_per_second = None

        node = start_node(home, env)
        done = wait_record(node, node_id, SHARDED, lambda r: r and r["kind"] == "DownloadCompleted", "resumed, done")
        assert (Path(done["path"]) / BIG_SHARD).read_bytes() == (root / "acme--sharded" / BIG_SHARD).read_bytes()
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"/download/start, kill -9 mid-file, restart: hub bytes / model = {ratio:.3f}")
        assert ratio < 1.2, ratio
    finally:
        stop_node(node)
        shutil.rmtree(home, ignore_errors=True)


def test_start_a_layer_range_then_the_rest(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    home = tmp_path / "home"
    node = start_node(home, {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        node_id = node.node_id()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        assert node.post("/models/add", json={"model_id": LAYERED}).status_code == 200
        started = node.post("/download/start", json={"model_id": LAYERED, "layers": [0, 2]})
        assert started.status_code == 200 and "layers 0-1 of" in started.json()["message"], started.text
        some = wait_record(node, node_id, LAYERED, lambda r: r and r["kind"] == "DownloadCompleted", "layers 0-1")
        assert tuple(some["layers"]) == (0, 2)
        held = {name for name in some["files"] if name.endswith(".safetensors")}
        assert held == files_for_layers(weight_map, (0, 2)) != set(weight_map.values())
        assert {f.name for f in home.rglob("*.safetensors")} == held

        # The whole model now: only the files still missing come from the hub.
        assert node.post("/download/start", json={"model_id": LAYERED}).status_code == 200
        whole = wait_record(
            node, node_id, LAYERED, lambda r: r and r["kind"] == "DownloadCompleted" and r["layers"] is None, "whole"
        )
        assert whole["path"] == str(home / "models" / "acme--layered")
        assert {f.name for f in home.rglob("*.safetensors")} == set(weight_map.values())
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"layers 0-1, then the whole model: hub bytes / model = {ratio:.3f}")
        assert ratio < 1.05, ratio
    finally:
        stop_node(node)
        shutil.rmtree(home, ignore_errors=True)
