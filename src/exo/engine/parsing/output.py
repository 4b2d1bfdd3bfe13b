"""One parser for a model's whole output: thinking, answer text and tool calls.

The engine builds it once per request from the model's family and the request's tools:
the reasoning parser splits thinking off first, and only the answer text goes on to the
tool-call parser, so a call the model merely thinks about is never run."""

from collections.abc import Container
from typing import Any

from exo.engine.parsing.base import Parsed, StreamParser
from exo.engine.parsing.dsml import DsmlParser
from exo.engine.parsing.harmony import HarmonyParser
from exo.engine.parsing.reasoning import ReasoningParser
from exo.engine.parsing.tool_calls import ToolCallParser, tool_call_format
from exo.shared.models.families import family_facts


def think_markers_for(model_type: str, detected: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """Where the model's reasoning starts and ends: the family table's markers where it has
    them (detection cannot tell Gemma 4's start marker includes a newline), else the ones
    detected from the tokenizer (mlx-lm's TokenizerWrapper finds `<think>`/`</think>` and
    the like in the vocabulary), so a thinking model of an ordinary architecture
    (DeepSeek-R1-Distill-Llama is `llama`, QwQ `qwen2`) has its reasoning split too."""
    return family_facts(model_type).think_markers or detected


# The single-token pairs mlx-lm's TokenizerWrapper looks for, in its order
# (tokenizer_utils._infer_thinking).
_THINK_TOKEN_PAIRS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)


def vocabulary_think_markers(vocab: Container[str]) -> tuple[str, str] | None:
    """The think markers mlx-lm's TokenizerWrapper detects in a vocabulary (its
    `think_start` / `think_end`, which the engine reads), by the same rules but without
    MLX, so the API process can tell from a tokenizer file what the engine will split."""
    for start, end in _THINK_TOKEN_PAIRS:
        if start in vocab and end in vocab:
            return start, end
    if "<|channel>" in vocab and "<channel|>" in vocab:
        return "<|channel>thought", "<channel|>"
    if all(token in vocab for token in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")):
        return "<|open|>think<|sep|>", "<|close|>think<|sep|>"
    return None


class _TemplateOnly:
    """Just enough of a tokenizer for mlx-lm's tool parser inference, which reads the
    chat template first and the vocabulary only as a fallback we do without."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template

    def get_vocab(self) -> dict[str, int]:
        return {}


def tool_format_for(model_type: str, chat_template: str | None) -> str | None:
    """The tool-call format a model writes, named as make_output_parser takes it.

    Harmony and DSML are told by model type (or their template's tokens); the rest the way
    mlx-lm tells them, from the chat template, falling back on the model type. A format
    mlx-lm knows and we have no name for comes back as its mlx-lm module name, which
    make_output_parser also accepts."""
    template = chat_template or ""
    by_model_type = family_facts(model_type).tool_format
    if by_model_type == "harmony" or ("<|channel|>" in template and "<|message|>" in template):
        return "harmony"
    if by_model_type == "dsml" or "｜DSML｜" in template:
        return "dsml"
    if template:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        inferred = _infer_tool_parser(_TemplateOnly(template))
        if inferred is not None:
            return "json" if inferred == "json_tools" else inferred
    return by_model_type


class OutputParser:
    """Reasoning first, then tool calls over the answer text; either part may be absent."""

    def __init__(self, reasoning: ReasoningParser | None, tool_calls: StreamParser | None) -> None:
        self.reasoning = reasoning
        self.tool_calls = tool_calls

    def feed(self, piece: str) -> Parsed:
        if self.reasoning is None:
            return self._tools(Parsed(text=piece), final=False)
        return self._tools(self.reasoning.feed(piece), final=False)

    def finish(self) -> Parsed:
        flushed = self.reasoning.finish() if self.reasoning is not None else Parsed()
        return self._tools(flushed, final=True)

    def _tools(self, parsed: Parsed, final: bool) -> Parsed:
        if self.tool_calls is None:
            return parsed
        out = Parsed(reasoning=parsed.reasoning, error=parsed.error)
        out.extend(self.tool_calls.feed(parsed.text) if parsed.text else Parsed())
        if final:
            out.extend(self.tool_calls.finish())
        return out


def make_output_parser(
    tool_format: str | None,
    think_start: str | None,
    think_end: str | None,
    starts_in_reasoning: bool,
    tools: list[dict[str, Any]] | None,
) -> StreamParser:
    if tool_format == "harmony":
        # Harmony's channels carry reasoning and tool calls both; think markers do not apply.
        return HarmonyParser(tools)
    reasoning = ReasoningParser(think_start, think_end, starts_in_reasoning) if think_start and think_end else None
    return OutputParser(reasoning, _tool_call_parser(tool_format, tools))


def _tool_call_parser(tool_format: str | None, tools: list[dict[str, Any]] | None) -> StreamParser | None:
    if tool_format is None:
        return None
    if tool_format == "dsml":
        return DsmlParser(tools=tools)
    return ToolCallParser(tool_call_format(tool_format), tools)
