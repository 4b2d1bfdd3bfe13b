"""What every output parser shares: it is fed the model's text one decoded piece at a
time and returns what can be shown so far. A parser holds back text that may still
turn out to be part of a marker, so no marker leaks into content and no text is lost."""

from dataclasses import dataclass, field
from typing import Protocol

from exo.shared.types.text_generation import ToolCall


@dataclass
class Parsed:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Set when the output cannot be parsed (say, a tool call left unclosed); the turn
    # then ends with finish_reason "error" and this message.
    error: str | None = None

    def extend(self, other: "Parsed") -> None:
        self.text += other.text
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        self.error = self.error or other.error


class StreamParser(Protocol):
    def feed(self, piece: str) -> Parsed: ...

    def finish(self) -> Parsed:
        """The end of the output: flush what was held back, report what is unclosed."""
