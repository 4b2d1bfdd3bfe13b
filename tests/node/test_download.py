"""Model downloads through huggingface_hub, against the fake hub in tests/support/fake_hub.py
(nothing here reaches the network beyond 127.0.0.1)."""

import asyncio
import json
import shutil
import socket
import struct
import time
from pathlib import Path

import pytest

from exo.catalog.catalog import local_cards
from exo.catalog.model_dirs import find_local_model_dir, is_complete_model_dir
from exo.devtools.tiny_models import make_tiny_llama
from exo.worker.download import (
    DownloadError,
    HubUnreachable,
    InvalidModelId,
    ModelNotOnHub,
    download_model,
    fetch_card,
    wanted_file,
)
from exo.worker.download import model as download
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)
from tests.support.node import start_node, stop_node

MB = 1024 * 1024
BIG_SHARD = "model-00002-of-00002.safetensors"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []

    def __call__(self, downloaded: int, total: int, bytes_per_second: float) -> None:
        self.calls.append((downloaded, total, bytes_per_second))

    def check_monotonic_to(self, total: int) -> None:
        assert self.calls, "no progress reported"
        downloaded = [call[0] for call in self.calls]
        assert downloaded == sorted(downloaded), downloaded
        assert all(call[1] == total for call in self.calls), self.calls
        assert all(call[2] >= 0 for call in self.calls)
        assert self.calls[-1][:2] == (total, total)


def run(coroutine):
    return asyncio.run(coroutine)


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {file.relative_to(path).as_posix(): file.read_bytes() for file in sorted(path.rglob("*")) if file.is_file()}


def write_safetensors(path: Path, tensor_bytes: int) -> None:
    """A valid safetensors file holding one uint8 tensor of zeros."""
    header = json.dumps({"pad": {"dtype": "U8", "shape": [tensor_bytes], "data_offsets": [0, tensor_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        zeros = bytes(MB)
        for start in range(0, tensor_bytes, MB):
            file.write(zeros[: min(MB, tensor_bytes - start)])


def make_sharded_model(path: Path, big_shard_bytes: int) -> None:
    """The tiny model split over two shards named by an index, the second one big; plus a
    consolidated copy the index does not name (which must not be downloaded)."""
    make_tiny_llama(path)
    shard1 = path / "model-00001-of-00002.safetensors"
    (path / "model.safetensors").rename(shard1)
    (header_length,) = struct.unpack("<Q", shard1.read_bytes()[:8])
    names = [name for name in json.loads(shard1.read_bytes()[8 : 8 + header_length]) if name != "__metadata__"]
    write_safetensors(path / BIG_SHARD, big_shard_bytes)
    weight_map = {name: shard1.name for name in names} | {"pad": BIG_SHARD}
    index = {"metadata": {"total_size": shard1.stat().st_size + big_shard_bytes}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(shard1, path / "consolidated.safetensors")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_downloads_a_byte_identical_model(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    source = make_tiny_llama(root / "acme--tiny")
    exo_home = tmp_path / "exo_home"
    progress = Recorder()

    path = run(download_model("acme/tiny", exo_home / "models", progress, endpoint=endpoint))

    assert path == exo_home / "models" / "acme--tiny"
    assert dir_bytes(path) == dir_bytes(source)
    assert is_complete_model_dir(path)
    assert find_local_model_dir("acme/tiny", exo_home) == path
    assert sorted(p.name for p in (exo_home / "models").iterdir()) == ["acme--tiny"]
    total = sum(len(content) for content in dir_bytes(source).values())
    progress.check_monotonic_to(total)
    assert len(progress.calls) >= len(dir_bytes(source)) + 1  # at least once per file


def test_uses_hf_endpoint_by_default(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub  # the fixture points HF_ENDPOINT at the fake hub
    make_tiny_llama(root / "acme--tiny")
    assert download.hub_endpoint() == endpoint
    path = run(download_model("acme/tiny", tmp_path / "models", Recorder()))
    assert is_complete_model_dir(path)


def test_second_download_is_a_no_op(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    run(download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint))
    fake_hub.requests.clear()
    progress = Recorder()

    path = run(download_model("acme/tiny", tmp_path / "models", progress, endpoint=endpoint))

    assert is_complete_model_dir(path)
    assert fake_hub.requests == []
    total = progress.calls[-1][1]
    assert progress.calls == [(total, total, 0.0)]


def test_concurrent_downloads_of_one_model_share_the_result(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")

    async def both():
        return await asyncio.gather(
            download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint),
            download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint),
        )

    first, second = run(both())
    assert first == second and is_complete_model_dir(first)
    assert sum(1 for method, path in fake_hub.requests if method == "GET" and path.endswith("model.safetensors")) == 1


def test_only_files_needed_to_run_are_downloaded(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    repo = make_tiny_llama(root / "acme--extras")
    (repo / "chat_template.jinja").write_text("{{ messages }}")
    (repo / "generation_config.json").write_text("{}")
    (repo / "README.md").write_text("# extras")
    (repo / "modeling_extras.py").write_text("raise SystemExit")
    (repo / "pytorch_model.bin").write_bytes(b"pickle")
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.safetensors").write_bytes(b"x")

    path = run(download_model("acme/extras", tmp_path / "models", Recorder(), endpoint=endpoint))

    assert sorted(dir_bytes(path)) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not wanted_file("original/model.safetensors") and wanted_file("tokenizer.model")


def test_progress_during_a_large_sharded_download(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=24 * MB)
    fake_hub.throttle_bytes_per_second = 8 * MB
    progress = Recorder()

    started = time.monotonic()
    path = run(download_model("acme/sharded", tmp_path / "models", progress, endpoint=endpoint))
    elapsed = time.monotonic() - started

    expected = {
        name: content
        for name, content in dir_bytes(root / "acme--sharded").items()
        if name != "consolidated.safetensors"
    }
    assert dir_bytes(path) == expected
    assert is_complete_model_dir(path)
    total = sum(len(content) for content in expected.values())
    progress.check_monotonic_to(total)
    # Progress moved while the big shard was still downloading, not only at file ends.
    before_big = total - 24 * MB
    inside = [call for call in progress.calls if before_big < call[0] < total]
    assert inside, progress.calls
    assert elapsed > 2  # throttled to 8 MB/s
    rates = [rate for downloaded, _, rate in progress.calls if downloaded > before_big]
    assert 1 * MB < max(rates) < 30 * MB, rates


def test_unknown_model_fails_clearly(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, _ = fake_hub
    with pytest.raises(DownloadError) as error:
        run(download_model("acme/nope", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert str(error.value) == f"model acme/nope was not found on {endpoint}"
    assert not (tmp_path / "models" / "acme--nope").exists()


def test_bad_model_id_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="not a hub model id"):
        run(download_model("../etc", tmp_path / "models", Recorder(), endpoint="http://127.0.0.1:9"))


def test_unreachable_hub_fails_quickly(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(DownloadError) as error:
        run(download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert time.monotonic() - started < 5
    assert str(error.value).startswith(f"could not reach {endpoint}: ")
    assert not (tmp_path / "models" / "acme--tiny").exists()


def test_missing_file_leaves_no_model_and_the_retry_resumes(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    exo_home = tmp_path / "exo_home"
    fake_hub.missing_files = {"model.safetensors"}

    with pytest.raises(DownloadError) as error:
        run(download_model("acme/tiny", exo_home / "models", Recorder(), endpoint=endpoint))

    assert str(error.value) == f"file model.safetensors of model acme/tiny was not found on {endpoint}"
    assert not (exo_home / "models" / "acme--tiny").exists()
    assert find_local_model_dir("acme/tiny", exo_home) is None
    assert "acme/tiny" not in local_cards(exo_home)

    # The next attempt fetches only what is still missing.
    fake_hub.missing_files = set()
    fake_hub.requests.clear()
    path = run(download_model("acme/tiny", exo_home / "models", Recorder(), endpoint=endpoint))
    assert is_complete_model_dir(path)
    fetched = [path for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert [Path(fetched_path).name for fetched_path in fetched] == ["model.safetensors"]
    assert sorted(p.name for p in (exo_home / "models").iterdir()) == ["acme--tiny"]


def test_hub_dying_mid_file_leaves_no_model(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=8 * MB)
    fake_hub.die_after_bytes = 3 * MB
    exo_home = tmp_path / "exo_home"

    with pytest.raises(DownloadError) as error:
        run(download_model("acme/sharded", exo_home / "models", Recorder(), endpoint=endpoint))

    assert not fake_hub.alive
    message = str(error.value)
    assert message.startswith(f"lost connection to {endpoint} while downloading acme/sharded"), message
    assert BIG_SHARD in message
    assert not (exo_home / "models" / "acme--sharded").exists()
    assert find_local_model_dir("acme/sharded", exo_home) is None
    assert "acme/sharded" not in local_cards(exo_home)
    # What arrived stays for the next attempt to resume from.
    (partial,) = (exo_home / "models").rglob(f"{BIG_SHARD}.partial")
    assert 0 < partial.stat().st_size <= 3 * MB


def test_cancelled_download_leaves_no_model_and_stops(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    big = 40 * MB
    make_sharded_model(root / "acme--sharded", big_shard_bytes=big)
    fake_hub.throttle_bytes_per_second = 8 * MB
    models = tmp_path / "models"

    async def start_then_cancel():
        progress = Recorder()
        task = asyncio.create_task(download_model("acme/sharded", models, progress, endpoint=endpoint))
        # Cancel once the big shard is partly downloaded.
        while not any(total - big < downloaded < total for downloaded, total, _ in progress.calls):
            assert not task.done()
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(start_then_cancel())
    assert not (models / "acme--sharded").exists()
    # The download thread notices the cancel at its next chunk and closes the connection,
    # so the hub stops sending; the bytes it got stay in the partial file.
    time.sleep(1)
    sent = fake_hub.body_bytes_sent
    time.sleep(1)
    assert fake_hub.body_bytes_sent == sent
    (partial,) = models.rglob(f"{BIG_SHARD}.partial")
    kept = partial.stat().st_size
    assert 0 < kept < big

    fake_hub.throttle_bytes_per_second = None
    fake_hub.requests.clear()
    before = fake_hub.body_bytes_sent
    path = run(download_model("acme/sharded", models, Recorder(), endpoint=endpoint))
    assert is_complete_model_dir(path)
    fetched = [Path(path).name for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert fetched == [BIG_SHARD]  # the files finished before the cancel were kept
    # ...and the big shard resumed where it stopped (a Range request for the rest).
    assert fake_hub.body_bytes_sent - before == (path / BIG_SHARD).stat().st_size - kept


def test_not_enough_disk_space_fails_before_downloading(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))

    with pytest.raises(DownloadError, match=r"^not enough disk space for model acme/tiny in "):
        run(download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert not [path for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert not (tmp_path / "models" / "acme--tiny").exists()


def test_existing_incomplete_dir_is_not_overwritten(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    (tmp_path / "models" / "acme--tiny").mkdir(parents=True)
    (tmp_path / "models" / "acme--tiny" / "notes.txt").write_text("mine")
    with pytest.raises(DownloadError, match="exists but is not a complete model dir"):
        run(download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert (tmp_path / "models" / "acme--tiny" / "notes.txt").read_text() == "mine"


def test_a_card_is_read_from_the_hub_without_the_weights(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    big = 3 * MB
    make_sharded_model(root / "acme--sharded", big_shard_bytes=big)
    card = fetch_card("acme/sharded", endpoint=endpoint)
    config = json.loads((root / "acme--sharded" / "config.json").read_text())
    assert card.model_id == "acme/sharded" and card.n_layers == config["num_hidden_layers"]
    # Only the shards the index names count, not the consolidated copy beside them.
    index = json.loads((root / "acme--sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert card.storage_size.in_bytes == sum((root / "acme--sharded" / name).stat().st_size for name in shards)
    fetched = [Path(path).name for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(fetched) == ["config.json", "model.safetensors.index.json"]

    with pytest.raises(ModelNotOnHub, match="was not found"):
        fetch_card("acme/absent", endpoint=endpoint)
    make_tiny_llama(root / "acme--not-a-language-model")
    (root / "acme--not-a-language-model" / "config.json").write_text('{"model_type": "vit", "image_size": 224}')
    with pytest.raises(DownloadError, match="config.json cannot be read as a model: .*no num_hidden_layers"):
        fetch_card("acme/not-a-language-model", endpoint=endpoint)
    with pytest.raises(InvalidModelId):
        fetch_card("../etc", endpoint=endpoint)
    with pytest.raises(HubUnreachable, match="could not reach"):
        fetch_card("acme/sharded", endpoint=f"http://127.0.0.1:{closed_port()}")


def test_a_node_downloads_a_placed_model_with_progress_then_serves_it(fake_hub: FakeHub, tmp_path: Path) -> None:
    import shutil

    import openai

    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--from-hub")
    # The node process gets the fake hub as its hub, and nothing else to reach.
    node = start_node(tmp_path / "home", {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        # The card comes from the hub's config.json and file list; no weights move yet.
        # Three 429s first: the node waits them out (Retry-After) instead of failing.
        fake_hub.retry_after, fake_hub.busy_answers = 0.3, 3
        added = node.post("/models/add", json={"model_id": "acme/from-hub"})
        assert fake_hub.busy_answers == 0
        assert added.status_code == 200, added.text
        card = added.json()
        config = json.loads((root / "acme--from-hub" / "config.json").read_text())
        assert (card["n_layers"], card["hidden_size"]) == (config["num_hidden_layers"], config["hidden_size"])
        assert card["storage_size"]["in_bytes"] == (root / "acme--from-hub" / "model.safetensors").stat().st_size
        assert not any("/resolve/main/model.safetensors" in path for _, path in fake_hub.requests)
        node.wait_for_state(lambda s: "acme/from-hub" in s["customModelCards"], what="custom card")
        assert "acme/from-hub" in [m["id"] for m in node.get("/v1/models").json()["data"]]
        make_tiny_llama(root / "acme--gated")
        fake_hub.gated_repos = {"acme/gated"}
        gated = node.post("/models/add", json={"model_id": "acme/gated"})
        assert gated.status_code == 403 and "HF_TOKEN" in gated.json()["error"]["message"], gated.text
        for model_id, status, code in (
            ("acme/not-there", 404, "model_not_found"),
            ("not a model id", 400, "invalid_model_id"),
        ):
            response = node.post("/models/add", json={"model_id": model_id})
            assert response.status_code == status and response.json()["error"]["code"] == code, response.text
        # A model with a card already gets that card back, from no hub.
        fake_hub.requests.clear()
        assert node.post("/models/add", json={"model_id": "exo/demo-chat"}).json()["model_id"] == "exo/demo-chat"
        assert fake_hub.requests == []

        node.place("acme/from-hub", timeout=120)
        kinds = [
            e["event"]["progress"]["kind"]
            for e in node.get("/events").json()
            if e["event"]["kind"] == "NodeDownloadProgress"
        ]
        assert kinds[0] == "DownloadPending" and kinds[-1] == "DownloadCompleted"
        downloaded = tmp_path / "home" / "models" / "acme--from-hub"
        assert (downloaded / "model.safetensors").read_bytes() == (
            root / "acme--from-hub" / "model.safetensors"
        ).read_bytes()
        sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = sdk.chat.completions.create(
            model="acme/from-hub", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert completion.usage.completion_tokens > 0
    finally:
        stop_node(node)
        shutil.rmtree(tmp_path / "home", ignore_errors=True)


def test_an_offline_node_reports_a_missing_model_instead_of_downloading(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--from-hub")
    card = {
        "model_id": "acme/from-hub",
        "n_layers": 2,
        "hidden_size": 64,
        "tasks": ["TextGeneration"],
        "context_length": 4096,
        "storage_size": {"in_bytes": 500000},
    }
    node = start_node(tmp_path / "home", {"HF_ENDPOINT": endpoint}, args=("--offline",))
    try:
        assert node.post("/models", json=card).status_code == 200
        node.wait_for_state(lambda s: "acme/from-hub" in s["customModelCards"], what="custom card")
        node_id = node.get("/node_id").json()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        instance_id = node.post("/place_instance", json={"model_id": "acme/from-hub"}).json()["instance_id"]
        state = node.wait_for_state(lambda s: instance_id in s["instanceDeletions"], timeout=30, what="given up")
        assert "offline" in state["instanceDeletions"][instance_id]
        refused = node.post("/models/add", json={"model_id": "acme/other"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "offline"
        assert fake_hub.requests == []
    finally:
        stop_node(node)
