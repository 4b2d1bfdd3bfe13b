"""A model llama.cpp refuses runs on MLX on a llama.cpp node (issue 33 point 4).

The tiny llama with a byte-level BPE tokenizer without merges (transformers and MLX take
it) converts to a GGUF llama.cpp will not load ('cannot find tokenizer merges in model
file'). Before, the runner failed 3 times and the instance was deleted. Now the runner
serves it on MLX and says why in its status; the node records the refusal beside its
GGUF cache and reports it in its NodeInfo, so the placement preview puts the next
instance on MLX and says why; and a restarted node whose llama.cpp instance comes back
from its event log loads it on MLX without converting it again."""

import shutil
import time
from pathlib import Path

import httpx

from exo.devtools.tiny_tokenizers import write_tokenizer_of_kind
from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

MODEL = "acme/nomerges"
LLAMACPP_SAYS = "cannot find tokenizer merges in model file"


def make_refused_model(models: Path, tiny_models_dir: Path) -> Path:
    """The tiny llama under MODEL in `models`, its tokenizer a byte-level BPE without merges."""
    model_dir = models / MODEL.replace("/", "--")
    shutil.copytree(tiny_models_dir / TINY_MODEL_ID.replace("/", "--"), model_dir)
    write_tokenizer_of_kind(model_dir, "bpe-no-merges")
    return model_dir


def chat(node: ExoNode) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the cat runs"}], "max_tokens": 6}
    response = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def runner_statuses(node: ExoNode, since: int = 0) -> list[dict]:
    events = node.get("/events", params={"since": since}).json()
    return [e["event"]["status"] for e in events if e["event"]["kind"] == "RunnerStatusUpdated"]


def conversions(statuses: list[dict]) -> int:
    """GGUF conversions done (each reports 100% once)."""
    return sum(
        1
        for s in statuses
        if s["kind"] == "RunnerLoading" and s["totalConvertBytes"] and s["convertedBytes"] == s["totalConvertBytes"]
    )


def serving_reasons(state: dict) -> list[str | None]:
    return [s.get("engineReason") for s in state["runners"].values() if s["kind"] in ("RunnerReady", "RunnerRunning")]


def test_a_model_llamacpp_refuses_serves_on_mlx_and_is_not_converted_again(tmp_path: Path, tiny_models_dir: Path):
    models = tmp_path / "models"
    make_refused_model(models, tiny_models_dir)
    home = tmp_path / "home"
    env = {"EXO_MODELS_DIRS": str(models)}

    with running_node(home, env, args=("--engine", "llamacpp")) as node:
        node.place(MODEL)
        assert chat(node)["usage"]["completion_tokens"] > 0
        state = node.state()
        (instance,) = state["instances"].values()
        assert instance["engine"] == "llamacpp"  # placed by its card; the runner found out
        (reason,) = serving_reasons(state)
        assert reason.startswith("runs on MLX: llama.cpp could not load the GGUF") and LLAMACPP_SAYS in reason
        statuses = runner_statuses(node)
        assert conversions(statuses) == 1 and not [s for s in statuses if s["kind"] == "RunnerFailed"]
        events_before_restart = len(node.get("/events").json())

        node_id = node.node_id()
        state = node.wait_for_state(
            lambda s: MODEL in s["nodes"][node_id]["llamacppRefusals"], timeout=30, what="the refusal in NodeInfo"
        )
        assert LLAMACPP_SAYS in state["nodes"][node_id]["llamacppRefusals"][MODEL]
        placed = [p for p in node.get("/instance/previews", params={"model_id": MODEL}).json() if p["instance"]]
        assert placed and all(p["instance"]["engine"] == "mlx" for p in placed)
        assert all(p["engineReason"].startswith("runs on MLX: ") and LLAMACPP_SAYS in p["engineReason"] for p in placed)

    # The llama.cpp instance comes back from the event log; the runner finds the record.
    assert not list((home / "cache" / "gguf").glob("*.gguf")), "the GGUF llama.cpp refused is kept"
    with running_node(home, env, args=("--engine", "llamacpp")) as node:
        deadline = time.monotonic() + 120
        while not [s for s in runner_statuses(node, events_before_restart) if s["kind"] == "RunnerReady"]:
            assert time.monotonic() < deadline, "the instance did not serve again after the restart"
            time.sleep(0.2)
        assert chat(node)["usage"]["completion_tokens"] > 0
        statuses = runner_statuses(node, events_before_restart)
        assert conversions(statuses) == 0, "the refused model was converted again"
        ready = [s for s in statuses if s["kind"] == "RunnerReady"]
        assert all(LLAMACPP_SAYS in s["engineReason"] for s in ready), ready
