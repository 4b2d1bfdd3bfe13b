"""A real node with an admission limit of 2 (EXO_MAX_BATCH): two long streams are
stepped, two more sent while they run wait, and the runner reports so (RunnerRunning
activeTasks 2, queuedTasks 2); every stream still completes, and the runner is Ready
after. The later two go out once the first two are stepped: sent all at once, a fast
engine (llama.cpp on this tiny model) finished one before the last arrived. The counts
are read from the event history, as a snapshot of /state can miss a short-lived one."""

import json
import threading
import time

import httpx

from tests.support.node import TINY_MODEL_ID, running_node

EOS_ID = 1  # make_tiny_llama's
# Two long answers fit the context (4096 cells) together.
LONG_TOKENS = 1500
SHORT_TOKENS = 100


def _stream(url: str, index: int, max_tokens: int, out: dict[int, int]) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": f"{index} the cat runs"}],
        "max_tokens": max_tokens,
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


def _reported_counts(node) -> list[tuple[int, int]]:
    """Every (active, queued) the runner reported, in order: from the event history, so
    a state that lasted less than a poll of /state is not missed."""
    return [
        (status["activeTasks"], status["queuedTasks"])
        for entry in node.get("/events").json()
        if entry["event"]["kind"] == "RunnerStatusUpdated"
        and (status := entry["event"]["status"])["kind"] == "RunnerRunning"
    ]


def _wait_reported(node, counts: tuple[int, int], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while counts not in _reported_counts(node):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {_reported_counts(node)}"
        time.sleep(0.05)


def test_requests_beyond_the_admission_limit_are_queued_and_reported_in_state(tmp_path, tiny_models_dir):
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_MAX_BATCH": "2"}
    with running_node(tmp_path / "home", env, models=[TINY_MODEL_ID]) as node:
        completed: dict[int, int] = {}
        sizes = [LONG_TOKENS, LONG_TOKENS, SHORT_TOKENS, SHORT_TOKENS]
        threads = [threading.Thread(target=_stream, args=(node.url, i, n, completed)) for i, n in enumerate(sizes)]
        for thread in threads[:2]:
            thread.start()
        _wait_reported(node, (2, 0), "the two long streams stepped")
        for thread in threads[2:]:
            thread.start()
        _wait_reported(node, (2, 2), "2 running and 2 queued")
        for thread in threads:
            thread.join(timeout=300)
        assert completed == dict(enumerate(sizes))
        # Never more than two stepped at once.
        assert all(running <= 2 for running, _ in _reported_counts(node)), _reported_counts(node)
        node.wait_for_state(
            lambda s: [r["kind"] for r in s["runners"].values()] == ["RunnerReady"], timeout=30, what="ready after"
        )
