"""Separating a model's thinking from its answer, in the stream and in the prompt.

Thinking models wrap their thoughts in a start and an end marker (`<think>`...`</think>`
for most families). The markers may arrive as one decoded piece or spread over several
(a marker made of several tokens, or a tokenizer that splits it), so the parser works on
text and holds back any tail that could still become a marker."""

from exo.engine.parsing.base import Parsed, find_first, held_suffix_length


class ReasoningParser:
    """Routes text between the start and end markers to `reasoning`, the rest to `text`.

    `starts_in_reasoning` is for prompts whose template already opened the thinking block
    (the prompt ends with "<think>\\n"), so the output begins inside it. A thinking block
    may open again later in the turn (interleaved thinking between tool calls)."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False) -> None:
        self.start = start
        self.end = end
        self.in_reasoning = starts_in_reasoning
        self.held = ""

    def feed(self, piece: str) -> Parsed:
        out = Parsed()
        buffer = self.held + piece
        while True:
            markers = [self.end] if self.in_reasoning else [self.start, self.end]
            found = find_first(buffer, markers)
            if found is None:
                break
            index, marker = found
            self._emit(out, buffer[:index])
            buffer = buffer[index + len(marker) :]
            # An end marker outside a block is dropped rather than shown: it means the
            # template opened the block without our knowing, and the marker is not content.
            self.in_reasoning = marker == self.start
        keep = held_suffix_length(buffer, markers)
        self._emit(out, buffer[: len(buffer) - keep])
        self.held = buffer[len(buffer) - keep :]
        return out

    def finish(self) -> Parsed:
        # What was held turned out not to be a marker (the output ended inside it): it is
        # text of whichever part we are in.
        out = Parsed()
        self._emit(out, self.held)
        self.held = ""
        return out

    def _emit(self, out: Parsed, text: str) -> None:
        if self.in_reasoning:
            out.reasoning += text
        else:
            out.text += text


def prompt_opens_reasoning(prompt_text: str, start: str, end: str) -> bool:
    """Whether the prompt leaves a thinking block open, so generation starts inside it:
    its last start marker has no end marker after it."""
    last_start = prompt_text.rfind(start)
    if last_start < 0:
        return False
    return prompt_text.find(end, last_start + len(start)) < 0


def repair_unmatched_end(token_ids: list[int], start_ids: list[int], end_ids: list[int]) -> list[int]:
    """Insert the start marker's ids right before every end marker that has no open start
    marker before it, so each end closes a block.

    Such prompts come from history: templates that open the block in the generation prompt
    render the earlier answer as "thoughts</think>answer". Where the thought began cannot be
    told from token ids, so the start goes directly before the end (as upstream exo does):
    the markers balance and nothing else in the prompt moves. Markers may span several
    tokens; they are matched as whole id sequences."""
    result: list[int] = []
    depth = 0
    i = 0
    while i < len(token_ids):
        if start_ids and token_ids[i : i + len(start_ids)] == start_ids:
            depth += 1
            result.extend(start_ids)
            i += len(start_ids)
        elif end_ids and token_ids[i : i + len(end_ids)] == end_ids:
            if depth == 0:
                result.extend(start_ids)
            else:
                depth -= 1
            result.extend(end_ids)
            i += len(end_ids)
        else:
            result.append(token_ids[i])
            i += 1
    return result
