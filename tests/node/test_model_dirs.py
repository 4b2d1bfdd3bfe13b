"""Several models dirs on a real node: a download goes to the writable dir with the most
free space (or the one already holding part of the model), and a read-only dir is used
where it is but never written, even when it is also listed as writable. The dirs with
different free space are /dev/shm (a tmpfs) and the test's tmp dir (the root disk)."""

import shutil
import uuid
from pathlib import Path

import openai

from exo.catalog.model_dirs import PARTIAL_DIR_NAME, download_dir
from exo.devtools.tiny_models import make_tiny_llama
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)
from tests.support.node import start_node, stop_node

SHM = Path("/dev/shm")


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file and dir under path, with size and mtime: what a write would change."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_downloads_go_to_the_roomiest_writable_dir_and_read_only_dirs_stay_untouched(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--fresh")
    shm = SHM / f"exo-test-{uuid.uuid4().hex[:8]}"
    home, small, big, read_only = shm / "home", shm / "small", tmp_path / "big", tmp_path / "ro"
    assert shutil.disk_usage(tmp_path).free > shutil.disk_usage(SHM).free, "the test needs /tmp roomier than /dev/shm"
    make_tiny_llama(read_only / "acme--ro-tiny")
    # A partial download of acme/fresh in the read-only dir, which must not be resumed there.
    (read_only / PARTIAL_DIR_NAME / "acme--fresh.partial").mkdir(parents=True)
    before = snapshot(read_only)
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # The read-only dir is listed as writable too: read-only wins.
        "EXO_MODELS_DIRS": f"{small}:{big}:{read_only}",
        "EXO_MODELS_READ_ONLY_DIRS": str(read_only),
    }
    node = start_node(home, env)
    try:
        node_id = node.node_id()
        state = node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        # The node reports the free space of its roomiest writable dir, not of EXO_HOME's disk.
        free = state["nodes"][node_id]["diskAvailableBytes"]
        assert abs(free - shutil.disk_usage(tmp_path).free) < 2**30, (free, shutil.disk_usage(tmp_path).free)
        assert node.post("/models/add", json={"model_id": "acme/fresh"}).status_code == 200
        assert node.post("/download/start", json={"model_id": "acme/fresh"}).status_code == 200
        state = node.wait_for_state(
            lambda s: s["downloads"].get(node_id, {}).get("acme/fresh", {}).get("kind") == "DownloadCompleted",
            what="acme/fresh downloaded",
        )
        record = state["downloads"][node_id]["acme/fresh"]
        assert record["path"] == str(big / "acme--fresh") and record["readOnly"] is False, record
        assert not (home / "models" / "acme--fresh").exists() and not (small / "acme--fresh").exists()

        # The read-only copy is found, used and served, and cannot be deleted.
        assert node.post("/download/start", json={"model_id": "acme/ro-tiny"}).status_code == 200
        state = node.wait_for_state(
            lambda s: s["downloads"].get(node_id, {}).get("acme/ro-tiny", {}).get("kind") == "DownloadCompleted",
            what="acme/ro-tiny found",
        )
        record = state["downloads"][node_id]["acme/ro-tiny"]
        assert record["path"] == str(read_only / "acme--ro-tiny") and record["readOnly"] is True, record
        refused = node.delete(f"/download/{node_id}/acme/ro-tiny")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "read_only_model_dir", refused.text
        node.place("acme/ro-tiny", timeout=120)
        sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = sdk.chat.completions.create(
            model="acme/ro-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert completion.usage is not None and completion.usage.completion_tokens > 0

        # The downloaded copy in a writable dir deletes; the read-only dir never changed.
        assert node.delete(f"/download/{node_id}/acme/fresh").status_code == 200
        node.wait_for_state(lambda s: "acme/fresh" not in s["downloads"].get(node_id, {}), what="deleted")
        assert not (big / "acme--fresh").exists()
        assert snapshot(read_only) == before
    finally:
        stop_node(node)
        shutil.rmtree(shm, ignore_errors=True)


def test_a_download_resumes_in_the_dir_holding_its_partial_files(tmp_path: Path, monkeypatch) -> None:
    roomy, cramped = tmp_path / "roomy", SHM / f"exo-test-{uuid.uuid4().hex[:8]}"
    try:
        monkeypatch.setenv("EXO_MODELS_DIRS", f"{cramped}:{roomy}")
        monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
        # $EXO_HOME/models and `roomy` share a disk: a tie, which the first listed wins
        # every time, however busy the disk (one free-space reading per disk).
        for _ in range(20):
            assert download_dir(tmp_path / "home", "acme/x") == tmp_path / "home" / "models"
        (cramped / PARTIAL_DIR_NAME / "acme--x.partial").mkdir(parents=True)
        assert download_dir(tmp_path / "home", "acme/x") == cramped
        monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(cramped))
        assert download_dir(tmp_path / "home", "acme/x") != cramped
    finally:
        shutil.rmtree(cramped, ignore_errors=True)
