"""A real node with an admission limit of 2 (EXO_MAX_BATCH): four streams at once, two
are stepped and two wait, and /state's runner says so (RunnerRunning activeTasks 2,
queuedTasks 2); every stream still completes, and the runner is Ready after."""

import json
import threading

import httpx

from tests.support.node import TINY_MODEL_ID, running_node

EOS_ID = 1  # make_tiny_llama's


def _stream(url: str, index: int, out: dict[int, int]) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": f"{index} the cat runs"}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
        "logit_bias": {str(EOS_ID): -100},
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage")
                if usage:
                    out[index] = usage["completion_tokens"]


def test_requests_beyond_the_admission_limit_are_queued_and_reported_in_state(tmp_path, tiny_models_dir):
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_MAX_BATCH": "2"}
    with running_node(tmp_path / "home", env, models=[TINY_MODEL_ID]) as node:
        completed: dict[int, int] = {}
        threads = [threading.Thread(target=_stream, args=(node.url, i, completed)) for i in range(4)]
        for thread in threads:
            thread.start()
        seen: set[tuple[int, int]] = set()

        def queued_reported(state: dict) -> bool:
            for status in state["runners"].values():
                if status["kind"] == "RunnerRunning":
                    seen.add((status["activeTasks"], status["queuedTasks"]))
            return (2, 2) in seen

        node.wait_for_state(queued_reported, timeout=120, what="2 running and 2 queued in /state")
        for thread in threads:
            thread.join(timeout=300)
        assert completed == {i: 300 for i in range(4)}
        # Never more than two stepped at once.
        assert all(running <= 2 for running, _ in seen), seen
        node.wait_for_state(
            lambda s: [r["kind"] for r in s["runners"].values()] == ["RunnerReady"], timeout=30, what="ready after"
        )
