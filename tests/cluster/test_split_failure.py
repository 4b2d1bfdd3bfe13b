"""A split instance whose every rank fails the same way (on NVIDIA, each rank's
`RuntimeError: There is no Stream(cpu, 2) in current thread`): restarted with the backoff,
then deleted with the error in /state, and not placed again by anything but the user.
The fault is real: a model dir whose config does not match its weights, so every rank's
load fails on its own layers. On llama.cpp nodes, llama.cpp refuses the GGUF and the split
is placed again on MLX first, where it fails so."""

import json
import shutil
import time

import pytest

from exo.worker.planner import RESTART_BACKOFF_SECONDS
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.node import TINY_MODEL_ID

BROKEN_MODEL_ID = "acme/broken"
# The tiny llama's MLP is 128 wide; told 96, every rank's load refuses its layers.
WRONG_INTERMEDIATE_SIZE = 96
# How each engine says so: MLX's strict load, llama.cpp's load of the converted GGUF.
LOAD_ERRORS = {"mlx": "Expected shape", "llamacpp": "llama.cpp could not load"}


def failures(events: list[dict]) -> list[tuple[str, int, str]]:
    """(runner, attempt, error) of every RunnerFailed in the history."""
    return [
        (e["event"]["runnerId"], e["event"]["status"]["attempt"], e["event"]["status"]["errorMessage"])
        for e in events
        if e["event"]["kind"] == "RunnerStatusUpdated" and e["event"]["status"]["kind"] == "RunnerFailed"
    ]


def kinds(events: list[dict]) -> list[str]:
    return [e["event"]["kind"] for e in events]


@pytest.mark.parametrize("engine", ["mlx", "llamacpp"])
def test_a_split_instance_failing_the_same_way_on_every_rank_is_given_up_on(engine, tmp_path, tiny_models_dir):
    load_error = LOAD_ERRORS[engine]
    models = tmp_path / "models"
    broken = models / BROKEN_MODEL_ID.replace("/", "--")
    shutil.copytree(tiny_models_dir / TINY_MODEL_ID.replace("/", "--"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = WRONG_INTERMEDIATE_SIZE
    (broken / "config.json").write_text(json.dumps(config))

    with loopback_cluster(2, tmp_path, {"EXO_MODELS_DIRS": str(models)}, args=("--engine", engine)) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        body = {"model_id": BROKEN_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2}
        response = nodes[0].post("/place_instance", json=body)
        assert response.status_code == 200, response.text
        instance_id = response.json()["instance_id"]
        if engine == "llamacpp":
            # llama.cpp refuses the GGUF, which moves the split to MLX at once
            # (test_llamacpp_split_refusal.py); there every rank fails on its own layers.
            state = nodes[0].wait_for_state(lambda s: instance_id in s["instanceDeletions"], timeout=60, what="moved")
            moved = state["instanceDeletions"][instance_id]
            assert load_error in moved and "on MLX" in moved, moved
            (instance_id,) = state["instances"]
            load_error = LOAD_ERRORS["mlx"]
        state = nodes[0].wait_for_state(lambda s: instance_id in s["instances"], timeout=30, what="placed")
        runners = state["instances"][instance_id]["shardAssignments"]["runnerToShard"]

        for node in nodes:
            state = node.wait_for_state(lambda s: instance_id in s["instanceDeletions"], timeout=120, what="given up")
            reason = state["instanceDeletions"][instance_id]
            # The runner's own error, on every node's /state.
            assert f"the runner of {BROKEN_MODEL_ID} failed 3 times" in reason, reason
            assert load_error in reason, reason

        # Longer than a fourth attempt's backoff would be: nothing comes back on its own.
        time.sleep(RESTART_BACKOFF_SECONDS * 3 + 1)
        for node in nodes:
            state = node.state()
            assert state["instances"] == {} and state["runners"] == {}
            assert node.runner_pids() == []
        events = nodes[0].get("/events").json()
        created = 2 if engine == "llamacpp" else 1
        assert kinds(events).count("InstanceCreated") == created and "InstanceRingMoved" not in kinds(events)
        # Both ranks failed on the same error (their own, or their peer's) at attempts 1
        # and 2; the first to fail a third time gave up, which stopped the other.
        seen = [failure for failure in failures(events) if failure[0] in runners]
        attempts = {runner: sorted(a for r, a, _ in seen if r == runner) for runner, _, _ in seen}
        assert len(attempts) == 2 and all(a[:2] == [1, 2] and a[-1] <= 3 for a in attempts.values()), seen
        assert any(a[-1] == 3 for a in attempts.values()), seen
        assert all(load_error in error for _, _, error in seen), seen

        # The user may place it again (once the dir is fixed); nothing else does.
        assert nodes[1].post("/place_instance", json=body).status_code == 200
