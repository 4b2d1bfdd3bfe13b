"""Downloads are verified, resumable and patient: against the fake hub (tests/support/
fake_hub.py) corrupting a file, answering 429 with Retry-After, guarding a gated repo,
and a download process killed with SIGKILL mid-file."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exo.devtools.tiny_models import make_tiny_llama
from exo.worker.download import (
    FileCorrupt,
    HubBusy,
    ModelNeedsToken,
    download_model,
    fetch_card,
)
from exo.worker.download.hub import MAX_ATTEMPTS, MAX_WAIT_SECONDS, retry_wait
from tests.node.test_download import BIG_SHARD, MB, Recorder, dir_bytes, make_sharded_model, run
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)
from tests.support.node import start_node, stop_node


def resolved(hub: FakeHub, name: str) -> int:
    return sum(
        1 for method, path in hub.requests if method == "GET" and "/resolve/" in path and path.endswith(f"/{name}")
    )


def test_a_corrupt_file_is_fetched_twice_then_reported_and_never_kept(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    fake_hub.corrupt_files = {"model.safetensors"}
    models = tmp_path / "models"

    with pytest.raises(FileCorrupt) as error:
        run(download_model("acme/tiny", models, Recorder(), endpoint=endpoint))

    assert str(error.value).startswith("file model.safetensors of model acme/tiny failed verification twice"), error
    assert resolved(fake_hub, "model.safetensors") == 2
    assert not list(models.rglob("model.safetensors*"))  # neither the file nor its partial
    assert not (models / "acme--tiny").exists()

    # A small (non-LFS) file is checked against its git blob id.
    fake_hub.corrupt_files = {"tokenizer.json"}
    with pytest.raises(FileCorrupt, match="file tokenizer.json of model acme/tiny failed verification"):
        run(download_model("acme/tiny", tmp_path / "other", Recorder(), endpoint=endpoint))

    fake_hub.corrupt_files = set()
    path = run(download_model("acme/tiny", models, Recorder(), endpoint=endpoint))
    assert dir_bytes(path) == dir_bytes(root / "acme--tiny")


def test_a_corrupt_file_fails_the_instance_naming_the_file(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--bad")
    fake_hub.corrupt_files = {"model.safetensors"}
    node = start_node(tmp_path / "home", {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        assert node.post("/models/add", json={"model_id": "acme/bad"}).status_code == 200
        node_id = node.node_id()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        instance_id = node.post("/place_instance", json={"model_id": "acme/bad"}).json()["instance_id"]
        state = node.wait_for_state(lambda s: instance_id in s["instanceDeletions"], timeout=60, what="given up")
        reason = state["instanceDeletions"][instance_id]
        assert "model.safetensors" in reason and "failed verification" in reason, reason
        record = state["downloads"][node_id]["acme/bad"]
        assert record["kind"] == "DownloadFailed" and "model.safetensors" in record["errorMessage"], record
        assert not list((tmp_path / "home" / "models").rglob("model.safetensors"))
        chat = node.post("/v1/chat/completions", json={"model": "acme/bad", "messages": [], "max_tokens": 1})
        assert chat.status_code != 200
    finally:
        stop_node(node)


KILLER = """
import asyncio, sys
from pathlib import Path
from exo.worker.download import download_model
asyncio.run(download_model(sys.argv[1], Path(sys.argv[2]), lambda *a: None, endpoint=sys.argv[3]))
"""


def test_kill_9_at_70_percent_then_restart_keeps_the_bytes(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=16 * MB)
    model_bytes = sum(
        len(b) for name, b in dir_bytes(root / "acme--sharded").items() if name != "consolidated.safetensors"
    )
    fake_hub.throttle_bytes_per_second = 8 * MB
    models = tmp_path / "models"
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    process = subprocess.Popen([sys.executable, "-c", KILLER, "acme/sharded", str(models), endpoint], env=env)
    try:
        deadline = time.monotonic() + 60
        while fake_hub.body_bytes_sent < 0.7 * model_bytes:
            assert process.poll() is None and time.monotonic() < deadline, "download ended before 70%"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    (partial,) = models.rglob(f"{BIG_SHARD}.partial")
    assert partial.stat().st_size > 0.5 * 16 * MB

    fake_hub.throttle_bytes_per_second = None
    path = run(download_model("acme/sharded", models, Recorder(), endpoint=endpoint))

    assert (path / BIG_SHARD).read_bytes() == (root / "acme--sharded" / BIG_SHARD).read_bytes()
    ratio = fake_hub.body_bytes_sent / model_bytes
    print(f"kill -9 at 70% then restart: hub bytes / model size = {ratio:.3f}")
    assert ratio < 1.4, ratio


def test_three_429s_then_success_honouring_retry_after(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--tiny")
    fake_hub.retry_after = 0.5

    fake_hub.busy_answers = 3  # the model info call meets them
    started = time.monotonic()
    path = run(download_model("acme/tiny", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert dir_bytes(path) == dir_bytes(root / "acme--tiny")
    assert time.monotonic() - started >= 1.5  # three waits of Retry-After: 0.5
    assert fake_hub.busy_answers == 0

    fake_hub.busy_answers = 3
    assert fetch_card("acme/tiny", endpoint=endpoint).model_id == "acme/tiny"

    # 503s on a file's bytes are retried as well.
    fake_hub.busy_status, fake_hub.retry_after, fake_hub.busy_match = 503, 0.1, "/resolve/"
    make_tiny_llama(root / "acme--other")
    fake_hub.busy_answers = 3
    path = run(download_model("acme/other", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert dir_bytes(path) == dir_bytes(root / "acme--other")
    assert fake_hub.busy_answers == 0

    # A hub that never stops being busy: a few tries, then a clear error.
    fake_hub.busy_match = ""
    fake_hub.busy_answers = 100
    with pytest.raises(HubBusy, match=f"kept answering HTTP 503 for model acme/tiny after {MAX_ATTEMPTS} tries"):
        fetch_card("acme/tiny", endpoint=endpoint)
    assert fake_hub.busy_answers == 100 - MAX_ATTEMPTS


def test_retry_after_is_honoured_and_capped() -> None:
    import httpx

    def answer(retry_after: str | None) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": retry_after} if retry_after else {})

    assert retry_wait(answer("3"), 1) == 3
    assert retry_wait(answer("100000"), 1) == MAX_WAIT_SECONDS
    assert retry_wait(answer(None), 1) < retry_wait(answer(None), 3) <= MAX_WAIT_SECONDS
    assert 0 <= retry_wait(answer("Wed, 21 Oct 2015 07:28:00 GMT"), 1) <= MAX_WAIT_SECONDS


def test_a_gated_model_says_to_set_hf_token(fake_hub: FakeHub, tmp_path: Path, monkeypatch) -> None:
    endpoint, root = fake_hub
    make_tiny_llama(root / "acme--gated")
    fake_hub.gated_repos = {"acme/gated"}
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ModelNeedsToken) as error:
        run(download_model("acme/gated", tmp_path / "models", Recorder(), endpoint=endpoint))
    assert "gated or private (HTTP 401)" in str(error.value) and "set HF_TOKEN" in str(error.value), error
    monkeypatch.setenv("HF_TOKEN", "hf_not_enough")
    with pytest.raises(ModelNeedsToken, match="the HF_TOKEN set on this node may not read it"):
        fetch_card("acme/gated", endpoint=endpoint)


def test_files_come_from_a_peer_that_holds_them_checked_like_the_hubs(fake_hub: FakeHub, tmp_path: Path) -> None:
    """A second fake hub over the same repo stands in for a peer's /peer-hub."""
    from tests.support.fake_hub import running_fake_hub

    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=4 * MB)
    with running_fake_hub(root) as peer:
        peers = {peer.endpoint: frozenset({BIG_SHARD})}
        path = run(download_model("acme/sharded", tmp_path / "a", Recorder(), endpoint=endpoint, peers=peers))
        assert (path / BIG_SHARD).read_bytes() == (root / "acme--sharded" / BIG_SHARD).read_bytes()
        assert resolved(peer, BIG_SHARD) == 1 and resolved(fake_hub, BIG_SHARD) == 0

        # A peer's bytes that do not match the hub's hash are dropped; the hub serves the file.
        peer.corrupt_files = {BIG_SHARD}
        path = run(download_model("acme/sharded", tmp_path / "b", Recorder(), endpoint=endpoint, peers=peers))
        assert (path / BIG_SHARD).read_bytes() == (root / "acme--sharded" / BIG_SHARD).read_bytes()
        assert resolved(peer, BIG_SHARD) == 3 and resolved(fake_hub, BIG_SHARD) == 1


def test_a_source_that_fails_takes_back_the_bytes_it_counted(fake_hub: FakeHub, tmp_path: Path) -> None:
    """A file resumed from its partial counts the partial's bytes; a source that then
    fails (a peer that does not have the file, or has not begun it) takes them back, so
    asking the next source, or the same peer again, does not count them twice."""
    import threading

    from exo.worker.download.hub import Call, DownloadError, client, list_repo
    from exo.worker.download.verify import fetch_verified, partial_path
    from tests.support.fake_hub import running_fake_hub

    endpoint, root = fake_hub
    make_sharded_model(root / "acme--sharded", big_shard_bytes=4 * MB)
    source = (root / "acme--sharded" / BIG_SHARD).read_bytes()
    target = tmp_path / "dl"
    target.mkdir()
    partial_path(target / BIG_SHARD).write_bytes(source[:MB])
    counted = []
    with running_fake_hub(root) as peer, client() as http:
        revision, listed = list_repo(http, Call(endpoint, "acme/sharded"))
        (file,) = [f for f in listed if f.name == BIG_SHARD]
        peer.missing_files = {BIG_SHARD}
        for _ in range(3):
            with pytest.raises(DownloadError):
                fetch_verified(
                    http,
                    Call(peer.endpoint, "acme/sharded", BIG_SHARD),
                    revision,
                    file,
                    target,
                    threading.Event(),
                    counted.append,
                )
            assert sum(counted) == 0, counted
        path = fetch_verified(
            http, Call(endpoint, "acme/sharded", BIG_SHARD), revision, file, target, threading.Event(), counted.append
        )
    assert path.read_bytes() == source and sum(counted) == len(source)
