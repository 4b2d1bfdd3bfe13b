"""One request's answer as tokens come, MLX-free: each generated token is decoded, held
back at a possible stop sequence, split by the family's output parser into reasoning,
text and tool calls, and turned into its chunk, with the finish reason once the answer
ends (EOS, a stop sequence, max_tokens, a parse error)."""

from collections.abc import Container
from typing import Any

from exo.engine.parsing.base import Parsed, StreamParser
from exo.engine.parsing.output import make_output_parser
from exo.engine.parsing.reasoning import prompt_opens_reasoning
from exo.engine.stop_sequences import StopSequenceFilter
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, FinishReason, TextGenerationTaskParams, TokenLogprob


def output_parser_for(
    params: TextGenerationTaskParams,
    prompt_text: str,
    think_markers: tuple[str, str] | None,
    tool_format: str | None,
) -> StreamParser:
    """The parser of a request's output: the model's think markers (open already if the
    prompt opened them), its tool-call format if the request offered tools."""
    # A raw prompt asks for the model's text as it is.
    if params.prompt is not None:
        return make_output_parser(None, None, None, False, None)
    start, end = think_markers or (None, None)
    opened = think_markers is not None and prompt_opens_reasoning(prompt_text, *think_markers)
    request_format = tool_format if params.tools and params.tool_choice != "none" else None
    if tool_format in ("harmony", "dsml"):
        # Harmony's channels are its whole output; DeepSeek writes a DSML block whether
        # or not the request offered tools, and raw markup is no answer.
        request_format = tool_format
    return make_output_parser(request_format, start, end, opened, params.tools)


class AnswerStream:
    """`detokenizer` has mlx-lm's streaming interface (add_token, finalize, last_segment)."""

    def __init__(
        self,
        command_id: CommandId,
        detokenizer: Any,
        parser: StreamParser,
        stop: list[str],
        eos_token_ids: Container[int],
        max_tokens: int,
    ) -> None:
        self.command_id = command_id
        self.detokenizer = detokenizer
        self.parser = parser
        self.stop_filter = StopSequenceFilter(stop)
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.generated = 0
        self.reasoning_tokens = 0
        self.made_tool_calls = False

    def feed(self, token: int, logprob: TokenLogprob | None = None) -> ChunkGenerated:
        """The chunk of one generated token; its finish_reason is set if the answer ends."""
        self.generated += 1
        finish_reason: FinishReason | None = None
        if token in self.eos_token_ids:
            finish_reason = "stop"
        else:
            self.detokenizer.add_token(token)
            if self.generated >= self.max_tokens:
                finish_reason = "length"
        if finish_reason is not None:
            self.detokenizer.finalize()
        text, stopped = self.stop_filter.feed(self.detokenizer.last_segment)
        if stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.stop_filter.flush()
        parsed = self.parser.feed(text) if text else Parsed()
        if finish_reason is not None:
            parsed.extend(self.parser.finish())
        if parsed.reasoning and not parsed.text:
            self.reasoning_tokens += 1
        self.made_tool_calls |= bool(parsed.tool_calls)
        if parsed.error is not None:
            finish_reason = "error"
        elif finish_reason == "stop" and self.made_tool_calls:
            finish_reason = "tool_calls"
        return ChunkGenerated(
            command_id=self.command_id,
            text=parsed.text,
            reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            token_ids=[token],
            logprobs=None if logprob is None else [logprob],
            finish_reason=finish_reason,
            stop_sequence=self.stop_filter.matched if finish_reason == "stop" else None,
            error_message=parsed.error,
        )
