"""Penalties and logit_bias reach the sampler: the real engine on a tiny random Llama,
in this process (no node), decoding greedily."""

import pytest
from pydantic import ValidationError

from exo.api.adapters.chat_completions import ChatCompletionRequest
from exo.api.adapters.chat_completions import to_task_params as chat_task_params
from exo.api.adapters.completions import CompletionRequest
from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.engine import load_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> MlxEngine:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return load_engine(model_dir)


def _greedy(engine: MlxEngine, max_tokens: int = 12, **sampling) -> list[int]:
    params = TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content="the cat runs over the quiet moon")],
        max_tokens=max_tokens,
        temperature=0.0,
        **sampling,
    )
    engine.submit("r", params)
    tokens: list[int] = []
    while engine.has_work:
        for chunk in engine.step():
            tokens += chunk.token_ids
    return tokens


def test_greedy_output_of_the_tiny_model_repeats_without_a_penalty(engine):
    # The premise of the next test: otherwise it would prove nothing.
    tokens = _greedy(engine)
    assert len(set(tokens)) < len(tokens), tokens


def test_strong_presence_penalty_never_repeats_a_token(engine):
    tokens = _greedy(engine, presence_penalty=2.0)
    assert len(set(tokens)) == len(tokens), tokens


def test_strong_repetition_penalty_never_repeats_a_token(engine):
    tokens = _greedy(engine, repetition_penalty=1000.0)
    assert len(set(tokens)) == len(tokens), tokens


def test_the_model_cards_presence_penalty_applies_when_the_request_sends_none(engine, monkeypatch):
    monkeypatch.setattr(engine, "card_defaults", {"presence_penalty": 2.0})
    tokens = _greedy(engine)
    assert len(set(tokens)) == len(tokens), tokens


def test_logit_bias_of_100_makes_that_token_the_greedy_choice(engine):
    assert _greedy(engine, max_tokens=5, logit_bias={200: 100.0}) == [200] * 5


def test_logit_bias_ignores_ids_outside_the_vocabulary(engine):
    assert _greedy(engine, max_tokens=5, logit_bias={10**9: 100.0, -1: 100.0}) == _greedy(engine, max_tokens=5)


@pytest.mark.parametrize("request_model", [ChatCompletionRequest, CompletionRequest])
def test_openai_requests_take_logit_bias_with_string_token_ids(request_model):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    request = request_model.model_validate({**body, "logit_bias": {"12": -100, "7": 3.5}, "frequency_penalty": 0.5})
    assert request.logit_bias == {12: -100.0, 7: 3.5}
    for bad in ({"x": 1}, {"-3": 1}, {"12": 101}):
        with pytest.raises(ValidationError):
            request_model.model_validate({**body, "logit_bias": bad})
    with pytest.raises(ValidationError):
        request_model.model_validate({**body, "presence_penalty": 2.5})


def test_chat_request_passes_penalties_bias_and_response_format_through():
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "presence_penalty": 1.0,
            "repetition_penalty": 1.1,
            "logit_bias": {"5": 2},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
        }
    )
    params = chat_task_params(request)
    assert (params.presence_penalty, params.repetition_penalty, params.logit_bias) == (1.0, 1.1, {5: 2.0})
    assert params.response_format == {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
