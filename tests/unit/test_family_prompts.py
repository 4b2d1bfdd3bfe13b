"""Golden prompts: a conversation with earlier reasoning and tool calls, rendered by the
engine's own render_prompt for each family's scripted tokenizer, card dialect and tools,
must match tests/unit/data/prompts/<family>.txt. EXO_REGENERATE_GOLDENS=1 rewrites the files.

The conversation asks about Paris (reasoning, a tool call, its result, an answer with
reasoning), then about Lyon (reasoning, a tool call, its result) and ends where the model
answers, so each dialect's rule shows: post_last_user keeps only the Lyon turn's
reasoning, tool_conditional, suffix and channel keep all of it, none drops it."""

import json
import os
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from exo.catalog.cards import builtin_cards, card_from_model_dir
from exo.devtools.scripted_families import FAMILIES, FAMILY_SCRIPTS, GET_WEATHER_TOOL
from exo.devtools.scripted_models import make_scripted_model
from exo.engine.mlx.chat_template import render_prompt
from exo.shared.models.model_cards import ReasoningDialect
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

GOLDEN_DIR = Path(__file__).parent / "data" / "prompts"
REGENERATE = os.environ.get("EXO_REGENERATE_GOLDENS") == "1"

PARIS_THOUGHT = "The user wants the weather in Paris."
PARIS_ANSWER_THOUGHT = "The tool says it is sunny in Paris."
LYON_THOUGHT = "Now they want Lyon; call the tool again."


def weather_call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


CONVERSATION = [
    ChatMessage(role="user", content="What is the weather in Paris?"),
    ChatMessage(
        role="assistant",
        content="Let me check.",
        reasoning_content=PARIS_THOUGHT,
        tool_calls=[weather_call("call_0", "Paris")],
    ),
    ChatMessage(role="tool", tool_call_id="call_0", name="get_weather", content='{"weather": "sunny"}'),
    ChatMessage(role="assistant", content="It is sunny in Paris.", reasoning_content=PARIS_ANSWER_THOUGHT),
    ChatMessage(role="user", content="And in Lyon?"),
    ChatMessage(
        role="assistant",
        content="Checking Lyon.",
        reasoning_content=LYON_THOUGHT,
        tool_calls=[weather_call("call_1", "Lyon")],
    ),
    ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content='{"weather": "rainy"}'),
]

# Which earlier thoughts reach the prompt under each family's dialect.
KEPT_THOUGHTS = {
    ReasoningDialect.post_last_user: [LYON_THOUGHT],
    ReasoningDialect.tool_conditional: [PARIS_THOUGHT, PARIS_ANSWER_THOUGHT, LYON_THOUGHT],
    ReasoningDialect.suffix: [PARIS_THOUGHT, PARIS_ANSWER_THOUGHT, LYON_THOUGHT],
    ReasoningDialect.channel: [PARIS_THOUGHT, PARIS_ANSWER_THOUGHT, LYON_THOUGHT],
    ReasoningDialect.none: [],
}
# DeepSeek V3.2's own format (the encoder it ships) writes reasoning only for turns after
# the last user message, whatever exo passes it: tool_conditional shows as post_last_user.
KEPT_BY_FORMAT = {"deepseek_v32": [LYON_THOUGHT]}


# A built-in card of each family's published models.
PUBLISHED_CARDS = {
    "qwen3": "mlx-community/Qwen3-Next-80B-A3B-Thinking-4bit",
    "glm4_moe": "mlx-community/GLM-4.7-4bit",
    "minimax": "mlx-community/MiniMax-M2.7-4bit",
    "kimi_k2": "mlx-community/Kimi-K2-Thinking",
    "gemma4": "mlx-community/gemma-4-26b-a4b-it-4bit",
    "gpt_oss": "mlx-community/gpt-oss-120b-MXFP4-Q8",
    "deepseek_v32": "mlx-community/DeepSeek-V3.2-4bit",
    "deepseek_v4": "mlx-community/DeepSeek-V4-Flash",
}


def rendered_prompt(tmp_path: Path, family: str) -> tuple[str, ReasoningDialect]:
    """The prompt the engine renders for CONVERSATION with the family's scripted model, and
    the dialect the model's card gives it."""
    model_dir = make_scripted_model(tmp_path / family, family, FAMILY_SCRIPTS[family].script)
    card = card_from_model_dir(model_dir, f"scripted/{family}")
    params = TextGenerationTaskParams(model=ModelId(card.model_id), messages=CONVERSATION, tools=[GET_WEATHER_TOOL])
    prompt = render_prompt(load_tokenizer(model_dir), params, FAMILIES[family].model_type, card.reasoning_dialect.value)
    return prompt, card.reasoning_dialect


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_prompt_matches_the_golden_file(tmp_path: Path, family: str) -> None:
    prompt, _ = rendered_prompt(tmp_path, family)

    golden = GOLDEN_DIR / f"{family}.txt"
    if REGENERATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(prompt, encoding="utf-8")
    assert golden.is_file(), f"{golden} is missing; EXO_REGENERATE_GOLDENS=1 writes it"
    assert prompt == golden.read_text(encoding="utf-8")


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_earlier_reasoning_follows_the_family_dialect(tmp_path: Path, family: str) -> None:
    prompt, dialect = rendered_prompt(tmp_path, family)

    kept = [thought for thought in (PARIS_THOUGHT, PARIS_ANSWER_THOUGHT, LYON_THOUGHT) if thought in prompt]
    assert kept == KEPT_BY_FORMAT.get(family, KEPT_THOUGHTS[dialect]), f"{family} ({dialect}) prompt:\n{prompt}"


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_a_local_model_gets_its_family_dialect(tmp_path: Path, family: str) -> None:
    _, dialect = rendered_prompt(tmp_path, family)

    assert dialect == builtin_cards()[PUBLISHED_CARDS[family]].reasoning_dialect
