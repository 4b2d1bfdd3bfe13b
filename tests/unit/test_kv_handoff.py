"""Disaggregated serving at the engine level (issue 36): one MLX engine prefills a
prompt, its KV goes part by part to another, which decodes. The greedy answer is the
one a single engine gives, for plain KV caches, sliding windows (Gemma 4's 16 tokens,
gpt-oss), SSM state (Qwen3-Next, Nemotron-H) and DeepSeek V4's compressed caches; parts
arrive while prefill is still going; a prompt the decode side's prefix cache holds moves
nothing, and an agent's next turn moves only what the decode side lacks.

Two real engines in this process, prompts as token ids (see test_agent_turn_cache.py for
why), 32 tokens a step so a prompt spans several chunks and every sliding window."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from exo.engine.kv_handoff import Handoff, LayerPart, offer_wanted
from exo.engine.mlx.engine import MlxEngine
from exo.engine.mlx.kv_transfer import KvAssembler, _restore, unpack
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams
from tests.support.engine import answers, load_engine, set_step_tokens, tokens_of, usage_of

ANSWER_TOKENS = 16
PROMPT_TOKENS = 150


def _params(prompt: list[int]) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("test/model"), messages=[], prompt=prompt, max_tokens=ANSWER_TOKENS, temperature=0.0
    )


def _alone(engine: MlxEngine, prompt: list[int]) -> list[int]:
    return tokens_of(answers(engine, {"alone": _params(prompt)})["alone"])


class _Handoff:
    """One request prefilled on `prefill` and decoded on `decode`: its answer, the bytes
    moved, how many parts arrived before prefill ended, and how many tokens of the
    decode side's cached prefix the prefill side was offered (it lacked them)."""

    def __init__(self, prefill: MlxEngine, decode: MlxEngine, prompt: list[int]) -> None:
        params = _params(prompt)
        handoff = decode.handoff_of(params, min_tokens=1)
        self.moved = self.early_parts = self.offered = 0
        self.sent_tokens = self.prefill_cached = 0
        if handoff is not None:
            self.sent_tokens = handoff.sent_tokens
            assembler = decode.kv_assembler(handoff)
            wanted = offer_wanted(prefill, handoff)
            if wanted is not None:
                offer = prefill.kv_assembler(wanted)
                for part in assembler.held_parts(wanted.skip):
                    offer.add(part)
                prefill.import_kv(CommandId("offered"), offer)
                self.offered = handoff.skip - wanted.skip
            parts: list[LayerPart] = []
            prefill.submit_prefill(CommandId("prefill"), handoff, parts.append)
            while prefill.has_work:
                before = len(parts)
                for chunk in prefill.step():
                    if chunk.finish_reason is not None:
                        self.early_parts = before
                        assert chunk.usage is not None
                        self.prefill_cached = chunk.usage.cached_tokens
            for part in parts:
                assembler.add(part)
            decode.import_kv(CommandId("decoded"), assembler)
            self.moved = assembler.bytes_received
        chunks = answers(decode, {"decoded": params})["decoded"]
        self.tokens = tokens_of(chunks)
        self.cached = usage_of(chunks).cached_tokens


def _prompt(engine: MlxEngine) -> list[int]:
    assert engine.tokenizer is not None
    text = "cluster node model token the cat runs over the quiet moon and sleeps " * 20
    return engine.tokenizer.encode(text)[:PROMPT_TOKENS]


def _fresh(monkeypatch, prefill: MlxEngine, decode: MlxEngine) -> list[int]:
    """Both engines at 32 tokens a step with empty prefix caches; the prompt."""
    for engine in (prefill, decode):
        set_step_tokens(monkeypatch, engine, 32)
        assert engine.scheduler is not None
        engine.scheduler.prefix_cache.clear()
    return _prompt(decode)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def engines(request, tmp_path_factory) -> tuple[str, MlxEngine, MlxEngine]:
    model_dir = make_tiny(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_engine(model_dir), load_engine(model_dir)


def test_decoding_another_engines_prefill_gives_the_single_engines_answer(engines, monkeypatch):
    family, prefill, decode = engines
    prompt = _fresh(monkeypatch, prefill, decode)
    alone = _alone(decode, prompt)
    decode.scheduler.prefix_cache.clear()

    handed = _Handoff(prefill, decode, prompt)
    print(f"{family}: {len(prompt)} tokens, {handed.moved} bytes moved, {handed.early_parts} parts before the end")
    assert handed.sent_tokens == len(prompt) - 1
    assert handed.moved > 0
    if any(type(layer) is KVCache for layer in make_prompt_cache(decode.model)):
        assert handed.early_parts > 0  # the decode side receives while prefill goes on
    assert handed.cached == len(prompt) - 1
    assert handed.tokens == alone

    again = _Handoff(prefill, decode, prompt)
    assert again.moved == 0  # the decode side's prefix cache holds the prompt
    assert again.tokens == alone


def test_a_next_turn_moves_only_what_the_decode_side_lacks(engines, monkeypatch):
    family, prefill, decode = engines
    prompt = _fresh(monkeypatch, prefill, decode)
    first = _Handoff(prefill, decode, prompt)
    assert decode.tokenizer is not None
    second_prompt = prompt + first.tokens + decode.tokenizer.encode(" and then? tell me more about the moon")
    second = _Handoff(prefill, decode, second_prompt)
    decode.scheduler.prefix_cache.clear()
    cold = _alone(decode, second_prompt)
    print(
        f"{family}: turn 1 moved {first.moved} bytes ({first.sent_tokens} tokens), "
        f"turn 2 {second.moved} bytes ({second.sent_tokens} of {len(second_prompt) - 1} tokens)"
    )
    assert second.tokens == cold
    assert 0 < second.sent_tokens < len(second_prompt) - len(prompt)
    # The prefill side's own prefix cache holds turn 1's prompt, the decode side offers
    # it what it holds beyond (the answer): only what neither held is prefilled.
    assert first.prefill_cached == first.offered == 0
    held_by_decode = len(second_prompt) - 1 - second.sent_tokens
    assert second.offered == held_by_decode - (len(prompt) - 1) > 0
    assert second.prefill_cached == held_by_decode


@pytest.mark.parametrize("with_answer", [True, False], ids=["next-turn", "other-continuation"])
def test_a_prefix_only_the_decode_side_holds_is_offered_to_the_prefill_side(engines, monkeypatch, with_answer):
    """The decode side answered a prompt itself (a short turn, or the prefill side lost
    its cache); a longer prompt starting with it (and its answer, or not: then a cache
    that can be trimmed is offered cut back to the shared part) is prefilled on the
    other side from where the decode side's cache ends, that prefix sent over first,
    not prefilled again."""
    family, prefill, decode = engines
    prompt = _fresh(monkeypatch, prefill, decode)
    answer = _alone(decode, prompt)
    assert decode.tokenizer is not None
    more = decode.tokenizer.encode(" and then? tell me more about the moon")
    longer = prompt + (answer if with_answer else []) + more
    handed = _Handoff(prefill, decode, longer)
    held_by_decode = len(longer) - 1 - handed.sent_tokens
    print(f"{family}: {handed.offered} tokens offered, {handed.sent_tokens} sent back")
    assert handed.offered == held_by_decode
    if with_answer or decode.scheduler.prefix_cache.find(prompt) is not None:
        assert held_by_decode > 0
    assert handed.prefill_cached == held_by_decode
    decode.scheduler.prefix_cache.clear()
    assert handed.tokens == _alone(decode, longer)


def test_a_trimmable_window_is_offered_as_it_stood_at_the_shared_prefix():
    """A sliding window not yet full can be trimmed, so a prefix cache entry holding it
    serves a shorter prefix: offered from such an entry, the window travels cut back to
    that prefix, and attends as one that saw only it (the tiny families' windows are
    full by the time the prompts above are cached)."""
    keys, values, more_keys, more_values = mx.random.normal((4, 1, 2, 40, 8)).split(4)
    held = RotatingKVCache(max_size=64)
    held.update_and_fetch(keys[0], values[0])
    shorter = RotatingKVCache(max_size=64)
    shorter.update_and_fetch(keys[0][..., :25, :], values[0][..., :25, :])
    assembler = KvAssembler(Handoff(list(range(26)), 25), [RotatingKVCache(max_size=64)], ([held], 40))

    [part] = assembler.held_parts(0)
    received = RotatingKVCache(max_size=64)
    _restore(received, unpack(part.payload))
    assert part.whole and part.end == 25 and received.offset == 25 and held.offset == 40
    # Fed the same next positions, both give attention the same keys and values.
    for got, want in zip(
        received.update_and_fetch(more_keys[0], more_values[0]),
        shorter.update_and_fetch(more_keys[0], more_values[0]),
        strict=True,
    ):
        assert got.shape == want.shape
        assert mx.array_equal(got, want)
