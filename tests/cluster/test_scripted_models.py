"""Scripted models write their script, token by token, under greedy decoding after the
family's own prompt, and exo's output parser reads the expected reasoning, content and
tool call out of it."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, load_tokenizer

from exo.devtools.scripted_families import (
    AFTER_TOOL_RESULT_SCRIPTS,
    FAMILIES,
    FAMILY_SCRIPTS,
    GET_WEATHER_TOOL,
    PLAIN_SCRIPT,
    SAMPLE_MESSAGES,
    SAMPLE_TOOL_RESULT_MESSAGES,
    ScriptedOutput,
)
from exo.devtools.scripted_models import make_scripted_model, render_prompt
from exo.engine.parsing.base import Parsed
from exo.engine.parsing.output import make_output_parser, think_markers_for, tool_format_for
from exo.engine.parsing.reasoning import prompt_opens_reasoning
from tests.support.ranks import run_ranks


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _generate(
    model_dir: Path, family: str, messages: list[dict] = SAMPLE_MESSAGES, limit: int = 40
) -> tuple[str, list[str], list[int], str]:
    """The prompt, the decoded pieces as the engine's detokenizer streams them, the token
    ids (EOS included) and the decoded text."""
    model, config = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    prompt = render_prompt(tokenizer, family, messages, [GET_WEATHER_TOOL])
    prompt_ids = mx.array(tokenizer.encode(prompt, add_special_tokens=False))
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens: list[int] = []
    segments: list[str] = []
    for token, _ in generate_step(prompt_ids, model, max_tokens=limit, sampler=_greedy):
        tokens.append(int(token))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(tokens[-1])
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    return prompt, [s for s in segments if s], tokens, detokenizer.text


def _parse(family: str, prompt: str, pieces: list[str]) -> Parsed:
    spec = FAMILIES[family]
    markers = think_markers_for(spec.model_type)
    think_start, think_end = markers or (None, None)
    starts_in_reasoning = bool(markers) and prompt_opens_reasoning(prompt, *markers)
    tool_format = tool_format_for(spec.model_type, spec.chat_template)
    parser = make_output_parser(tool_format, think_start, think_end, starts_in_reasoning, [GET_WEATHER_TOOL])
    out = Parsed()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_greedy_output_is_the_script_and_parses(tmp_path: Path, family: str) -> None:
    expected = FAMILY_SCRIPTS[family]
    model_dir = make_scripted_model(tmp_path / family, family, expected.script)

    prompt, segments, tokens, text = _generate(model_dir, family)

    tokenizer = load_tokenizer(model_dir)
    assert tokens[-1] == tokenizer.convert_tokens_to_ids(FAMILIES[family].eos)
    assert len(tokens) == len(expected.script) + 1
    assert text == expected.text
    for pieces in (segments, list(expected.script)):
        parsed = _parse(family, prompt, pieces)
        assert parsed.error is None
        assert parsed.reasoning == expected.reasoning
        assert parsed.text == expected.content
        assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == list(expected.tool_calls)


def _assert_writes(model_dir: Path, family: str, messages: list[dict], expected: ScriptedOutput) -> None:
    prompt, segments, tokens, text = _generate(model_dir, family, messages)
    assert len(tokens) == len(expected.script) + 1
    assert text == expected.text
    for pieces in (segments, list(expected.script)):
        parsed = _parse(family, prompt, pieces)
        assert parsed.error is None
        assert parsed.reasoning == expected.reasoning
        assert parsed.text == expected.content
        assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == list(expected.tool_calls)


@pytest.mark.parametrize("family", sorted(AFTER_TOOL_RESULT_SCRIPTS))
def test_a_tool_result_switches_to_the_second_script(tmp_path: Path, family: str) -> None:
    first, second = FAMILY_SCRIPTS[family], AFTER_TOOL_RESULT_SCRIPTS[family]
    model_dir = make_scripted_model(tmp_path / family, family, first.script, after_tool_result=second.script)

    _assert_writes(model_dir, family, SAMPLE_MESSAGES, first)
    _assert_writes(model_dir, family, SAMPLE_TOOL_RESULT_MESSAGES, second)


def test_a_plain_script_is_content_alone(tmp_path: Path) -> None:
    model_dir = make_scripted_model(tmp_path / "plain", "qwen3", PLAIN_SCRIPT.script)

    _assert_writes(model_dir, "qwen3", SAMPLE_MESSAGES, PLAIN_SCRIPT)


def test_a_piece_shared_by_both_scripts_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must not repeat"):
        make_scripted_model(tmp_path / "m", "qwen3", ["a", "b"], after_tool_result=["c", "a"])


def test_a_second_script_needs_a_family_with_a_tool_result_prompt_end(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="after a tool result"):
        make_scripted_model(tmp_path / "m", "gemma4", ["a"], after_tool_result=["b"])


def test_a_repeated_piece_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must not repeat"):
        make_scripted_model(tmp_path / "m", "qwen3", ["a", "b", "a"])


def test_the_prompt_end_token_cannot_be_a_piece(tmp_path: Path) -> None:
    # Qwen3's generation prompt ends with "\n" after "<|im_start|>assistant".
    with pytest.raises(ValueError, match="last token"):
        make_scripted_model(tmp_path / "m", "qwen3", ["Hi", "\n", "there"])


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v4"])
def test_split_over_two_ranks_writes_the_script(tmp_path: Path, family: str) -> None:
    expected = FAMILY_SCRIPTS[family]
    model_dir = make_scripted_model(tmp_path / family, family, expected.script)
    tokenizer = load_tokenizer(model_dir)
    prompt = render_prompt(tokenizer, family, SAMPLE_MESSAGES, [GET_WEATHER_TOOL])
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)

    # Each rank of a 2-way pipeline split (the engine's own loading and sharding, over the
    # MLX ring on loopback), greedy after the prompt.
    decode = ["--decode-steps", str(len(expected.script) + 1)]
    ranks = [rank["tokens"].tolist() for rank in run_ranks(model_dir, tmp_path, "pipeline", 2, prompt_ids, decode)]

    eos = tokenizer.convert_tokens_to_ids(FAMILIES[family].eos)
    for tokens in ranks:
        assert tokens[-1] == eos
        assert tokenizer.decode(tokens[:-1]) == expected.text
