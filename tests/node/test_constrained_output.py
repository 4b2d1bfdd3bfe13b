"""response_format constrains decoding to JSON: the real engine on a tiny random Llama
(byte-level BPE), in this process, whose unconstrained output is noise."""

import json

import openai
import pytest
from transformers import AutoTokenizer

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.mlx.constrained import grammar_for
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.engine import load_engine
from tests.support.node import TINY_MODEL_ID

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "colour", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> MlxEngine:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return load_engine(model_dir)


def _generate(engine: MlxEngine, response_format, seed: int = 0, **sampling) -> tuple[str, str | None]:
    params = TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content="Answer in JSON.")],
        max_tokens=200,
        temperature=1.0,
        seed=seed,
        response_format=response_format,
        **sampling,
    )
    engine.submit("r", params)
    text, finish = "", None
    while engine.has_work:
        for chunk in engine.step():
            text += chunk.text
            finish = chunk.finish_reason or finish
    return text, finish


def _matches_schema(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "colour", "count"}
        and isinstance(value["ok"], bool)
        and value["colour"] in ("red", "green", "blue")
        and type(value["count"]) is int
        and 0 <= value["count"] <= 99
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_and_validates(engine, seed):
    text, finish = _generate(engine, {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, seed)
    assert finish == "stop", text
    assert _matches_schema(json.loads(text)), text


def test_json_object_output_is_a_json_object(engine):
    # A random model may never close an open-ended object; a bias toward "}" (which the
    # grammar masks wherever it would be invalid) lets it finish within max_tokens.
    closing = engine.tokenizer.encode("}", add_special_tokens=False)
    text, finish = _generate(engine, {"type": "json_object"}, logit_bias={closing[-1]: 5.0})
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict), text


def test_text_format_leaves_output_unconstrained(engine):
    text, _ = _generate(engine, {"type": "text"})
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize(
    "response_format",
    [{"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frob"}}}],
)
def test_unusable_response_formats_are_refused(response_format):
    with pytest.raises(ValueError):
        grammar_for(response_format)


def test_json_object_through_a_node_with_the_openai_sdk(exo_node, tiny_models_dir):
    exo_node.place()
    client = openai.OpenAI(base_url=f"{exo_node.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / TINY_MODEL_ID.replace("/", "--"))
    closing = tokenizer.encode("}", add_special_tokens=False)[-1]
    completion = client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "Describe the moon as JSON."}],
        max_tokens=200,
        seed=3,
        response_format={"type": "json_object"},
        logit_bias={str(closing): 5},
    )
    text = completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=TINY_MODEL_ID,
            messages=[{"role": "user", "content": "hi"}],
            logit_bias={"not-a-token": 5},
        )
    bad_schema = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frob"}}}
    response = exo_node.post(
        "/v1/chat/completions",
        json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "response_format": bad_schema},
    )
    assert response.status_code == 400, response.text
    assert "frob" in response.json()["error"]["message"]
