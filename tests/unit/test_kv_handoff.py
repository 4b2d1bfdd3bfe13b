"""Disaggregated serving at the engine level (issue 36): one MLX engine prefills a
prompt, its KV goes part by part to another, which decodes. The greedy answer is the
one a single engine gives, for plain KV caches, sliding windows (Gemma 4's 16 tokens,
gpt-oss), SSM state (Qwen3-Next, Nemotron-H) and DeepSeek V4's compressed caches; parts
arrive while prefill is still going; a prompt the decode side's prefix cache holds moves
nothing, and an agent's next turn moves only what the decode side lacks.

Two real engines in this process, prompts as token ids (see test_agent_turn_cache.py for
why), 32 tokens a step so a prompt spans several chunks and every sliding window."""

import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from exo.engine.kv_handoff import LayerPart
from exo.engine.mlx.engine import MlxEngine
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
    moved, and how many parts arrived before prefill ended."""

    def __init__(self, prefill: MlxEngine, decode: MlxEngine, prompt: list[int]) -> None:
        params = _params(prompt)
        handoff = decode.handoff_of(params, min_tokens=1)
        self.moved = self.early_parts = 0
        self.sent_tokens = self.prefill_cached = 0
        if handoff is not None:
            self.sent_tokens = handoff.sent_tokens
            assembler = decode.kv_assembler(handoff)
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
    # The prefill side's own prefix cache holds turn 1's prompt: only the answer and the
    # new message are prefilled there.
    assert first.prefill_cached == 0
    assert second.prefill_cached == len(prompt) - 1
