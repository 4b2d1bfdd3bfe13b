"""Penalties and logit_bias reach the sampler: the real engine on a tiny random Llama,
in this process (no node), decoding greedily."""

import pytest

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.mlx.engine import MlxEngine
from exo.shared.models.model_cards import card_from_model_dir
from exo.shared.types.common import ModelId
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> MlxEngine:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    card = card_from_model_dir(model_dir, "test/model")
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    engine = MlxEngine()
    engine.load(model_dir, shard, lambda done, total: None)
    return engine


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


def test_logit_bias_of_100_makes_that_token_the_greedy_choice(engine):
    assert _greedy(engine, max_tokens=5, logit_bias={200: 100.0}) == [200] * 5


def test_logit_bias_ignores_ids_outside_the_vocabulary(engine):
    assert _greedy(engine, max_tokens=5, logit_bias={10**9: 100.0, -1: 100.0}) == _greedy(engine, max_tokens=5)
