"""One real exo node, driven over HTTP with the official openai SDK."""

import json
import os
import subprocess
import sys
import time
from urllib.parse import urlparse

import openai
import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, start_node, stop_node


def client(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def runner_kinds(state: dict) -> list[str]:
    return [status["kind"] for status in state["runners"].values()]


def test_place_chat_and_delete_with_state_checked_at_each_step(exo_node: ExoNode):
    state = exo_node.wait_for_state(lambda s: s["nodes"], what="node info")
    assert state["instances"] == {} and state["runners"] == {} and state["tasks"] == {}
    assert state["masterNodeId"] == exo_node.get("/node_id").json()

    models = client(exo_node).models.list()
    assert TINY_MODEL_ID in [m.id for m in models.data]

    instance_id = exo_node.place()
    state = exo_node.state()
    assert list(state["instances"]) == [instance_id]
    assert runner_kinds(state) == ["RunnerReady"]
    assert state["downloads"][exo_node.get("/node_id").json()][TINY_MODEL_ID]["kind"] == "DownloadCompleted"

    stream = client(exo_node).chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text
    assert finish_reasons in (["length"], ["stop"])
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    completion = client(exo_node).chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0.0,
    )
    # Greedy decoding of the same prompt gives the same text, streamed or not.
    assert completion.choices[0].message.content == text
    assert completion.choices[0].finish_reason == finish_reasons[0]
    assert completion.usage.completion_tokens == usage.completion_tokens
    stats = completion.model_extra["generation_stats"]
    assert stats["prompt_tps"] > 0 and stats["generation_tokens"] == usage.completion_tokens
    if usage.completion_tokens > 1:
        assert stats["generation_tps"] > 0

    # Finished tasks leave State once their streams are done.
    exo_node.wait_for_state(lambda s: s["tasks"] == {}, what="tasks cleared")

    response = exo_node.delete(f"/instance/{instance_id}")
    assert response.status_code == 200
    state = exo_node.wait_for_state(lambda s: s["instances"] == {}, what="instance deleted")
    assert state["runners"] == {}
    deadline = time.monotonic() + 10
    while exo_node.runner_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert exo_node.runner_pids() == []
    assert exo_node.get(f"/instance/{instance_id}").status_code == 404


def test_stop_sequences_and_sampling_parameters(exo_node: ExoNode):
    exo_node.place()
    openai_client = client(exo_node)
    base = (
        openai_client.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "cat"}], max_tokens=20, temperature=0.0
        )
        .choices[0]
        .message.content
    )
    assert len(base) > 3
    stop = base[2:4]
    stopped = openai_client.chat.completions.create(
        model=TINY_MODEL_ID, messages=[{"role": "user", "content": "cat"}], max_tokens=20, temperature=0.0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == base[: base.index(stop)]

    def sampled(seed: int) -> str:
        return (
            openai_client.chat.completions.create(
                model=TINY_MODEL_ID,
                messages=[{"role": "user", "content": "dog"}],
                max_tokens=16,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 50, "min_p": 0.01},
            )
            .choices[0]
            .message.content
        )

    assert sampled(7) == sampled(7)


def test_killed_runner_fails_its_stream_and_node_keeps_serving(exo_node: ExoNode):
    import os
    import signal

    exo_node.place()
    openai_client = client(exo_node)
    stream = openai_client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "tell me everything"}],
        max_tokens=200000,
        # Greedy, so the random model's answer is the same long one every run (sampled,
        # it sometimes ended before the kill).
        temperature=0,
        stream=True,
    )
    received = 0
    with pytest.raises(openai.APIError) as raised:
        for _chunk in stream:
            received += 1
            if received == 5:
                (runner_pid,) = exo_node.runner_pids()
                os.kill(runner_pid, signal.SIGKILL)
    assert received >= 5
    assert "runner process exited unexpectedly" in str(raised.value)

    state = exo_node.wait_for_state(lambda s: "RunnerFailed" in runner_kinds(s), timeout=10, what="RunnerFailed")
    (failed,) = [s for s in state["runners"].values() if s["kind"] == "RunnerFailed"]
    assert "exit code -9" in failed["errorMessage"]

    # The node itself still answers, and the instance comes back by itself.
    assert exo_node.get("/v1/models").status_code == 200
    exo_node.wait_for_state(lambda s: runner_kinds(s) == ["RunnerReady"], timeout=60, what="runner restarted")
    completion = openai_client.chat.completions.create(
        model=TINY_MODEL_ID, messages=[{"role": "user", "content": "again"}], max_tokens=5
    )
    assert completion.choices[0].message.content is not None
    assert completion.usage.completion_tokens > 0


def test_event_log_survives_a_restart(tmp_path, tiny_models_dir):
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir)}
    first = start_node(tmp_path / "home", env)
    try:
        node_id = first.get("/node_id").json()
        instance_id = first.place()
        events_before = first.get("/events").json()
    finally:
        stop_node(first)

    second = start_node(tmp_path / "home", env)
    try:
        assert second.get("/node_id").json() == node_id
        deadline = time.monotonic() + 15
        while True:
            events_after = second.get("/events").json()
            elections = [e["idx"] for e in events_after if e["event"]["kind"] == "MasterElected"]
            if len(elections) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # The new master continues the same history rather than starting over.
        assert events_after[: len(events_before)] == events_before
        assert len(elections) == 2 and elections[1] >= len(events_before)
        # The instance comes back and serves again.
        second.wait_for_state(
            lambda s: instance_id in s["instances"] and runner_kinds(s) == ["RunnerReady"],
            timeout=60,
            what="instance restored",
        )
        sdk = client(second)
        completion = sdk.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert completion.usage.completion_tokens > 0
    finally:
        stop_node(second)


def test_an_instance_that_keeps_failing_is_retried_then_deleted_with_its_reason(tmp_path, tiny_models_dir):
    import shutil

    models = tmp_path / "models"
    broken = models / "acme--broken"
    shutil.copytree(tiny_models_dir / "acme--tiny", broken)
    # Weights that do not fit their config (a truncated file is refused before placement).
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))

    node = start_node(tmp_path / "home", {"EXO_MODELS_DIRS": str(models)})
    try:
        node_id = node.get("/node_id").json()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        response = node.post("/place_instance", json={"model_id": "acme/broken"})
        assert response.status_code == 200, response.text
        instance_id = response.json()["instance_id"]
        state = node.wait_for_state(
            lambda s: instance_id in s["instanceDeletions"], timeout=90, what="instance given up"
        )
        assert instance_id not in state["instances"]
        reason = state["instanceDeletions"][instance_id]
        assert "failed 3 times" in reason
        attempts = [
            e["event"]["status"]["attempt"]
            for e in node.get("/events").json()
            if e["event"]["kind"] == "RunnerStatusUpdated" and e["event"]["status"]["kind"] == "RunnerFailed"
        ]
        assert attempts == [1, 2, 3]
    finally:
        stop_node(node)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_runners_do_not_outlive_a_killed_node(exo_node: ExoNode):
    import os
    import signal

    exo_node.place()
    runner_pids = exo_node.runner_pids()
    assert runner_pids
    os.kill(exo_node.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    alive = runner_pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in runner_pids if _running(p)]
    assert alive == [], "runner processes were left behind"


def test_placement_dry_run_and_the_bench_endpoint(exo_node: ExoNode):
    node_id = exo_node.node_id()
    exo_node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")

    # The dry run creates nothing, and /place_instance then places exactly that layout.
    planned = exo_node.get("/instance/placement", params={"model_id": TINY_MODEL_ID})
    assert planned.status_code == 200, planned.text
    planned = planned.json()
    assert planned["shardAssignments"]["modelId"] == TINY_MODEL_ID
    assert list(planned["shardAssignments"]["nodeToRunner"]) == [node_id]
    assert exo_node.state()["instances"] == {}
    too_many = exo_node.get("/instance/placement", params={"model_id": TINY_MODEL_ID, "min_nodes": 2})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["code"] == "placement_failed"
    assert "at least 2 needed" in too_many.json()["error"]["message"]

    instance_id = exo_node.place()
    [shard] = exo_node.state()["instances"][instance_id]["shardAssignments"]["runnerToShard"].values()
    [planned_shard] = planned["shardAssignments"]["runnerToShard"].values()
    assert (shard["startLayer"], shard["endLayer"]) == (planned_shard["startLayer"], planned_shard["endLayer"])

    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "time me"}], "max_tokens": 8}
    bench = exo_node.post("/bench/chat/completions", json=body)
    assert bench.status_code == 200, bench.text
    result = bench.json()
    stats = result["generation_stats"]
    assert stats["generation_tokens"] == result["usage"]["completion_tokens"] > 0
    assert stats["prompt_tokens"] == result["usage"]["prompt_tokens"] > 0
    assert stats["prompt_tps"] > 0 and stats["peak_memory_bytes"] > 0
    assert result["choices"][0]["message"]["role"] == "assistant"

    streamed = exo_node.post("/bench/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_a_second_node_on_a_busy_api_port_says_so_and_leaves_the_first_alone(exo_node: ExoNode, tmp_path):
    port = str(urlparse(exo_node.url).port)
    second = subprocess.run(
        [sys.executable, "-m", "exo.main", "--api-port", port, "--api-host", "127.0.0.1", "--no-multicast"],
        env={**os.environ, "EXO_HOME": str(tmp_path / "second")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode != 0
    assert f"port {port} is already in use" in second.stderr and "--api-port" in second.stderr
    assert not (tmp_path / "second" / "config" / "node_id").exists()  # it stopped before starting anything
    state = exo_node.state()
    assert list(state["nodes"]) in ([], [exo_node.node_id()])


def test_models_can_be_filtered_to_the_downloaded_ones(exo_node: ExoNode):
    every = {card["model_id"] for card in exo_node.get("/models").json()}
    downloaded = {card["model_id"] for card in exo_node.get("/models", params={"status": "downloaded"}).json()}
    # The tiny models are dirs in EXO_MODELS_DIRS, the demo model ships in the package;
    # the built-in cards of big models have nothing on disk here.
    assert {TINY_MODEL_ID, "exo/demo-chat"} <= downloaded < every
    assert "mlx-community/gemma-4-e2b-it-4bit" in every - downloaded
    bad = exo_node.get("/models", params={"status": "somewhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.status"
