"""A second prompt sharing a long prefix with an earlier one resumes from its cached
state: usage reports the cached tokens, and the greedy answer equals a cold run's.

Runs the real engine in this process (no node): DeepSeek V4, whose cache cannot be
trimmed (resumed from a prefill snapshot), and Llama, whose cache is trimmed back."""

import pytest

from exo.devtools.tiny_models import make_tiny
from exo.engine.mlx import engine as engine_module
from exo.engine.mlx.engine import MlxEngine
from exo.engine.mlx.prefix_cache import PrefixCache
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.engine import load_engine

PREFIX = "cluster node model token the cat runs over the quiet moon " * 12


def _answer(engine: MlxEngine, question: str) -> tuple[list[int], int]:
    params = TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=PREFIX + question)],
        max_tokens=12,
        temperature=0.0,
    )
    engine.submit("r", params)
    tokens = []
    while engine.has_work:
        for chunk in engine.step():
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                assert chunk.usage is not None
                return tokens, chunk.usage.cached_tokens
    raise AssertionError("no final chunk")


@pytest.mark.parametrize("arch", ["deepseek_v4", "llama"])
def test_shared_prefix_is_reused_and_answers_like_a_cold_run(arch, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "PREFILL_STEP", 16)
    engine = load_engine(make_tiny(tmp_path / arch, arch))
    _, cached_first = _answer(engine, "what sleeps?")
    warm, cached_second = _answer(engine, "what runs fast?")
    assert cached_first == 0
    # At least all whole 16-token chunks of the shared prefix came from the cache.
    assert cached_second >= 100, cached_second

    engine.prefix_cache = PrefixCache(engine.model, engine.model_type)
    cold, cached_cold = _answer(engine, "what runs fast?")
    assert cached_cold == 0
    assert warm == cold
