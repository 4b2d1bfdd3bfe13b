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
        ...


def find_first(text: str, markers: list[str]) -> tuple[int, str] | None:
    """The earliest complete marker in text, with its index; ties go to the longer marker
    so "<|tool_calls_section_begin|>" wins over a shorter marker that is its prefix."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker)
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(marker) > len(best[1])):
            best = (index, marker)
    return best


def held_suffix_length(text: str, markers: list[str]) -> int:
    """How many trailing characters of text could be the start of a marker and must be held
    back until the next piece shows whether they are one."""
    longest = max((len(marker) for marker in markers), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0
