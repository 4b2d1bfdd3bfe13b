"""Speculative decoding with a draft model through a real MLX node and the official
OpenAI SDK: the placement names the draft, rank 0's node finds it in its models dir and
loads it beside the model, a request asking for "draft" gets the plain greedy text with
every proposal of an agreeing draft kept (the model's own scripted weights at one layer),
and the errors are 4xx in OpenAI's shape: an unknown draft at placement, "draft" on an
instance placed without one."""

from collections.abc import Iterator

import openai
import pytest

from exo.devtools.scripted_models import make_copy_model
from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

TARGET, DRAFT = "acme/copy", "acme/copy-draft"


@pytest.fixture(scope="module")
def node_and_prompt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ExoNode, list[int]]]:
    models = tmp_path_factory.mktemp("models")
    prompt = make_copy_model(models / TARGET.replace("/", "--"), 150, config_overrides={"num_hidden_layers": 4})
    make_copy_model(models / DRAFT.replace("/", "--"), 150, config_overrides={"num_hidden_layers": 1})
    from exo.devtools.tiny_models import make_tiny_llama

    make_tiny_llama(models / TINY_MODEL_ID.replace("/", "--"))
    home = tmp_path_factory.mktemp("home") / "home"
    with running_node(home, {"EXO_MODELS_DIRS": str(models)}, args=("--engine", "mlx")) as exo:
        exo.place(TARGET, draft_model=DRAFT)
        exo.place(TINY_MODEL_ID)
        yield exo, prompt


def _sdk(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_draft_placed_with_the_model_gives_the_plain_text(node_and_prompt):
    node, prompt = node_and_prompt
    instances = node.get("/state").json()["instances"].values()
    [instance] = [i for i in instances if i["shardAssignments"]["modelId"] == TARGET]
    assert instance["draftModel"] == DRAFT
    sdk = _sdk(node)
    asked = {"model": TARGET, "prompt": prompt, "max_tokens": 100, "temperature": 0}
    plain = sdk.completions.create(**asked)
    drafted = sdk.completions.create(**asked, extra_body={"speculative": {"method": "draft", "num_draft": 6}})
    assert drafted.choices[0].text == plain.choices[0].text
    assert plain.usage.completion_tokens == 100
    details = drafted.usage.completion_tokens_details
    print(f"kept {details.accepted_prediction_tokens}, not kept {details.rejected_prediction_tokens}")
    assert details.accepted_prediction_tokens >= 80 and details.rejected_prediction_tokens == 0


def test_draft_errors_are_4xx(node_and_prompt):
    node, _ = node_and_prompt
    unknown = node.post("/place_instance", json={"model_id": TARGET, "draft_model": "acme/nowhere"})
    assert unknown.status_code == 404, unknown.text
    assert "acme/nowhere" in unknown.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="needs a draft model"):
        _sdk(node).chat.completions.create(
            model=TINY_MODEL_ID,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"speculative": {"method": "draft"}},
        )
