"""gpt-oss output in OpenAI's Harmony format, parsed by hand over decoded text.

(openai-harmony would do this over token ids, but it downloads its vocabulary at run time
and our machines have no network.) An answer is a run of messages, each a header and a
body:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city":"Paris"}<|call|>

(the arguments follow <|message|> directly; the line break is for reading). The recipient
(`to=...`) may also come before `<|channel|>`. Generation starts after a prompt ending in
`<|start|>assistant`, so the first header has no `<|start|>`. Channels map to our parts:
analysis to reasoning, final to text, commentary to a tool call when it has a recipient
and to text (a preamble) when it has none."""

import re

from exo.engine.parsing.base import Parsed, find_first, held_suffix_length
from exo.engine.parsing.tool_calls import to_tool_calls

MESSAGE = "<|message|>"
# <|return|> and <|call|> are end-of-generation tokens: the engine may stop before
# feeding them, so finish() closes an open message as they would.
MESSAGE_ENDS = ["<|end|>", "<|return|>", "<|call|>"]

_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools
        self.in_message = False
        self.channel = ""
        self.recipient: str | None = None
        self.held = ""
        self.call_body = ""

    def feed(self, piece: str) -> Parsed:
        out = Parsed()
        buffer = self.held + piece
        while True:
            if not self.in_message:
                index = buffer.find(MESSAGE)
                if index < 0:
                    # A header is never shown, so all of it waits for <|message|>.
                    self.held = buffer
                    return out
                self._open(buffer[:index])
                buffer = buffer[index + len(MESSAGE) :]
            found = find_first(buffer, MESSAGE_ENDS)
            if found is None:
                keep = held_suffix_length(buffer, MESSAGE_ENDS)
                self._body(out, buffer[: len(buffer) - keep])
                self.held = buffer[len(buffer) - keep :]
                return out
            index, marker = found
            self._body(out, buffer[:index])
            self._close(out)
            buffer = buffer[index + len(marker) :]

    def finish(self) -> Parsed:
        out = Parsed()
        if self.in_message:
            self._body(out, self.held)
            self._close(out)
        elif "<|" not in self.held:
            # No header at all: the model answered in plain text, which is still the answer.
            out.text = self.held
        # Otherwise a header was cut off before its message began: nothing to show.
        self.held = ""
        return out

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else ""
        self.recipient = recipient.group(1) if recipient else None
        self.in_message = True
        self.call_body = ""

    def _body(self, out: Parsed, text: str) -> None:
        if self.recipient is not None:
            # Arguments are JSON that is only useful whole: keep them until the call ends.
            self.call_body += text
        elif self.channel == "analysis":
            out.reasoning += text
        else:
            out.text += text

    def _close(self, out: Parsed) -> None:
        self.in_message = False
        if self.recipient is None:
            return
        name = self.recipient.removeprefix("functions.")
        try:
            out.tool_calls.extend(to_tool_calls({"name": name, "arguments": self.call_body}, self.tools))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            out.error = out.error or f"could not parse the harmony tool call to {name}: {exc}: {self.call_body[:200]!r}"
        self.recipient = None
        self.call_body = ""
