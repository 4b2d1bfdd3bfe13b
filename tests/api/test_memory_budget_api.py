"""A node whose runners have a small memory budget (EXO_MEMORY_BUDGET_MB), on each engine:
`/state` shows the runner's budget and how many tokens of prompt and answer fit; a
prompt within the model's context but beyond what that memory holds is a 400 in the
API's own shape saying how many tokens fit, and the node serves the next request."""

from pathlib import Path

import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

# MB for each engine: MLX also budgets one step's activations (~2 MB for this model).
BUDGETS = {"llamacpp": "2", "mlx": "4"}


@pytest.fixture(scope="module", params=list(BUDGETS))
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path):
    budget = BUDGETS[request.param]
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_ENGINE": request.param, "EXO_MEMORY_BUDGET_MB": budget}
    home = tmp_path_factory.mktemp(f"budget-{request.param}") / "exo_home"
    with running_node(home, env, models=[TINY_MODEL_ID]) as exo:
        yield exo


def _runner_memory(node: ExoNode) -> dict:
    runners = node.get("/state").json()["runners"]
    memories = [status.get("memory") for status in runners.values() if status.get("memory")]
    assert memories, runners
    return memories[0]


def test_state_shows_the_budget_and_a_prompt_beyond_it_is_a_400(node: ExoNode):
    memory = _runner_memory(node)
    fits = memory["runningTokens"]
    print(f"runner memory: {memory}")
    # Fewer than the card's context of 4,096: what the memory holds bounds it.
    assert 0 < fits < 4000 and memory["kvBytesPerToken"] > 0 and memory["budgetBytes"] < 4 << 20
    too_long = [5] * (fits + 10)
    response = node.post("/v1/completions", json={"model": TINY_MODEL_ID, "prompt": too_long, "max_tokens": 4})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"holds {fits} tokens" in message, message

    served = node.post("/v1/completions", json={"model": TINY_MODEL_ID, "prompt": [5] * 64, "max_tokens": 4})
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] >= 1


def test_claude_messages_gets_the_400_in_its_own_shape(node: ExoNode):
    fits = _runner_memory(node)["runningTokens"]
    words = " ".join(["moon"] * (fits + 50))
    body = {"model": TINY_MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": words}]}
    response = node.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and "tokens of prompt and answer" in response.json()["error"]["message"]
