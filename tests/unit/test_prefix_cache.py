"""A second prompt sharing a long prefix with an earlier one resumes from its cached
state: usage reports the cached tokens, and the greedy answer equals a cold run's.

Runs the real engine in this process (no node): DeepSeek V4, whose cache cannot be
trimmed (resumed from a prefill snapshot), Llama, whose cache is trimmed back, and
Gemma 4 (dense with KV-shared layers, and MoE), whose sliding layers' rotating caches
cannot be trimmed once the prompt is past their window (16 tokens; the prompt is ~130):
there the warm answer's log-probabilities, top 20 per token, equal a cold run's
within 1e-4, for an extended prompt and for the same prompt again. And the cache's
bookkeeping on its own: a long prompt's boundary snapshots thinned to one per octave of
length, and least recently used entries giving way to a budget of tokens."""

import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from exo.engine.mlx.engine import MlxEngine
from exo.engine.prefix_cache import PrefixCache, SavedKV
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.engine import load_engine, set_step_tokens

PREFIX = "cluster node model token the cat runs over the quiet moon " * 12
TOP = 20
LOGPROB_TOLERANCE = 1e-4


def _answer(engine: MlxEngine, question: str) -> tuple[list[int], np.ndarray, int]:
    """The greedy tokens, each step's top-20 log-probabilities by token id, and how many
    prompt tokens came from the cache."""
    params = TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=PREFIX + question)],
        max_tokens=12,
        temperature=0.0,
        logprobs=True,
        top_logprobs=TOP,
    )
    engine.submit("r", params)
    tokens, rows = [], []
    while engine.has_work:
        for chunk in engine.step():
            tokens += chunk.token_ids
            for logprob in chunk.logprobs or []:
                rows.append(sorted((top.token_id, top.logprob) for top in logprob.top_logprobs))
            if chunk.finish_reason is not None:
                assert chunk.usage is not None
                return tokens, np.array(rows), chunk.usage.cached_tokens
    raise AssertionError("no final chunk")


def _cold(engine: MlxEngine, question: str) -> tuple[list[int], np.ndarray, int]:
    engine.scheduler.prefix_cache.clear()
    return _answer(engine, question)


@pytest.mark.parametrize("arch", ["deepseek_v4", "llama"])
def test_shared_prefix_is_reused_and_answers_like_a_cold_run(arch, tmp_path, monkeypatch):
    engine = load_engine(make_tiny(tmp_path / arch, arch))
    set_step_tokens(monkeypatch, engine, 16)
    _, _, cached_first = _answer(engine, "what sleeps?")
    warm, _, cached_second = _answer(engine, "what runs fast?")
    assert cached_first == 0
    # At least all whole 16-token chunks of the shared prefix came from the cache.
    assert cached_second >= 100, cached_second

    cold, _, cached_cold = _cold(engine, "what runs fast?")
    assert cached_cold == 0
    assert warm == cold


@pytest.fixture(scope="module", params=["gemma4", "gemma4_moe"])
def gemma4(request, tmp_path_factory) -> tuple[str, MlxEngine]:
    return request.param, load_engine(make_tiny(tmp_path_factory.mktemp(request.param), request.param))


@pytest.mark.parametrize("second", ["what runs fast?", "what sleeps?"], ids=["extended", "repeated"])
def test_gemma4_prefix_is_reused_past_the_sliding_window(gemma4, second, monkeypatch):
    name, engine = gemma4
    set_step_tokens(monkeypatch, engine, 16)
    config = TINY_CONFIGS[name]
    text_config = config.get("text_config", config)
    cache_kinds = {type(c) for c in make_prompt_cache(engine.model)}
    assert RotatingKVCache in cache_kinds and len(cache_kinds) == 2  # sliding and full layers

    engine.scheduler.prefix_cache.clear()
    _, _, cached_first = _answer(engine, "what sleeps?")
    warm, warm_logprobs, cached_second = _answer(engine, second)
    assert cached_first == 0
    # Every whole 16-token chunk of the shared prefix, many windows past the first.
    assert cached_second >= 100 > 4 * text_config["sliding_window"], cached_second

    cold, cold_logprobs, cached_cold = _cold(engine, second)
    assert cached_cold == 0
    assert warm_logprobs.shape == cold_logprobs.shape == (12, TOP, 2)
    assert np.array_equal(warm_logprobs[..., 0], cold_logprobs[..., 0])  # the same top tokens
    diff = float(np.abs(warm_logprobs[..., 1] - cold_logprobs[..., 1]).max())
    print(f"{name} {second!r}: {cached_second} cached, max |logprob diff| {diff:.2e}")
    assert diff <= LOGPROB_TOLERANCE
    assert warm == cold


def _saved(length: int, trimmable: bool = False) -> SavedKV:
    """An entry's saved KV: what it holds is the backend's, the cache sees tokens."""
    return SavedKV(snapshot=None, length=length, nbytes=64, trimmable=trimmable)


def test_a_long_prompt_keeps_one_boundary_snapshot_per_octave_of_length():
    cache = PrefixCache(max_entries=100)
    prompt = list(range(1024))
    for end in range(32, 1025, 32):
        cache.remember_boundary(prompt[:end], _saved(end))
    # 32 boundaries; kept: the longest in each octave of length below 1024 (32..63,
    # 64..127, 128..255, 256..511, 512..1023) and 1024 itself.
    assert sorted(len(entry.tokens) for entry in cache._entries) == [32, 32 * 3, 32 * 7, 32 * 15, 32 * 31, 1024]
    # A prompt sharing 700 tokens resumes from the longest kept snapshot inside them.
    found = cache.find(prompt[:700] + [5000, 5001])
    assert found is not None and found[1] == 32 * 15


def test_entries_give_way_least_recently_used_first_to_a_budget_of_tokens():
    cache = PrefixCache(max_entries=16)
    for index in range(4):
        cache.remember([index] * 10, _saved(10, trimmable=True))
    assert cache.held_tokens == 40
    used = cache.find([3] * 10 + [7])
    assert used is not None and used[1] == 10
    # Room for 25 tokens, entry 0 kept (a request is about to copy it): 1 and 2 go.
    cache.evict(25, keep=cache._entries[0].saved)
    assert sorted(int(entry.tokens[0]) for entry in cache._entries) == [0, 3]
    cache.evict(0)
    assert cache.held_tokens == 0 and len(cache) == 0
