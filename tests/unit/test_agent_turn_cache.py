"""An agent's second turn (turn 1, its answer, a new message) prefills only the new
message: the prefix cache holds turn 1's prompt and answer once it finishes, for a cache
that can be trimmed (llama) and for caches that cannot, resumed from the finished
request's own cache (DeepSeek V4's compressed branches, Gemma 4's sliding windows past
their 16 tokens, Qwen3-Next's SSM state). Usage reports >= 95% of turn 1 + its answer
as cached, and the second turn's greedy answer is the one a cold engine gives.

Turn 2 is given as token ids (a raw prompt: turn 1's chat prompt, its answer's tokens, the
new message's): a random tiny model's answer is no text that tokenizes back to itself
(invalid UTF-8 bytes, reserved tokens), so re-rendering it through the chat template would
test the tokenizer, not the cache. Runs the real engine in this process (no node)."""

import pytest

from exo.devtools.tiny_models import make_tiny
from exo.engine.mlx.chat_template import encode_prompt
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.engine import load_engine, set_step_tokens

SYSTEM = "You are a terse assistant for a cluster of home computers. " * 3
QUESTION = "cluster node model token the cat runs over the quiet moon " * 6 + "what sleeps?"
ANSWER_TOKENS = 24


def _turn(engine: MlxEngine, params: TextGenerationTaskParams) -> tuple[list[int], int, int]:
    """The answer's tokens, its prompt's length and the prompt tokens cached."""
    engine.submit(CommandId("turn"), params.model_copy(update={"max_tokens": ANSWER_TOKENS, "temperature": 0.0}))
    tokens = []
    while engine.has_work:
        for chunk in engine.step():
            tokens += chunk.token_ids
            if chunk.usage is not None:
                return tokens, chunk.usage.prompt_tokens, chunk.usage.cached_tokens
    raise AssertionError("no final chunk")


@pytest.mark.parametrize("arch", ["llama", "deepseek_v4", "gemma4", "qwen3_next"])
def test_second_agent_turn_prefills_only_the_new_message(arch, tmp_path, monkeypatch):
    engine = load_engine(make_tiny(tmp_path / arch, arch))
    set_step_tokens(monkeypatch, engine, 32)
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=QUESTION)]
    first = TextGenerationTaskParams(model=ModelId("test/model"), messages=messages)
    first_tokens = encode_prompt(engine.tokenizer, first, engine.model_type, engine.reasoning_dialect)[0]
    answer, first_prompt, _ = _turn(engine, first)
    assert first_prompt == len(first_tokens)
    new_message = engine.tokenizer.encode(" and then? tell me more", add_special_tokens=False)
    second = first.model_copy(update={"messages": [], "prompt": first_tokens + answer + new_message})

    warm, second_prompt, cached = _turn(engine, second)
    turn_one = first_prompt + len(answer)
    print(f"{arch}: turn 1 + answer {turn_one} tokens, turn 2 {second_prompt}, cached {cached}")
    assert second_prompt > turn_one
    assert cached >= 0.95 * turn_one, (cached, turn_one)

    engine.scheduler.prefix_cache.clear()
    cold, _, cached_cold = _turn(engine, second)
    assert cached_cold == 0
    assert warm == cold
