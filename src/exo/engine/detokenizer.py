"""Streaming text from token ids with a Hugging Face tokenizer, MLX-free: each token's
text is what decoding the last few tokens adds to decoding them without it, so
byte-level pieces of one character, and SentencePiece's leading spaces, come out right.
Special tokens are text too (think markers, tool-call tags).

Bytes that may still become a character with the next tokens decode to replacement
characters at the end of the text: one (byte-level BPE, Rust's lossy UTF-8) or one per
byte (SentencePiece's byte fallback), so at most 3. Only those last 3 are held; every
replacement character before them is final (bytes that can no longer be one). A model
that emits invalid bytes for a while (a random one does) streams them as it goes, not
all at once at its first valid character."""

from typing import Any

# Tokens decoded again before the new one: enough context for a multi-byte character.
_CONTEXT = 6
# Replacement characters an incomplete character (at most 3 of its bytes) decodes to.
_MAX_HELD = 3


class StreamingDetokenizer:
    """The interface of mlx-lm's detokenizers that exo reads: add_token, finalize and
    last_segment (the text since the last read)."""

    def __init__(self, tokenizer: Any) -> None:
        # A tokenizers.Tokenizer (a fast HF tokenizer's backend_tokenizer): its decode
        # is a direct call into Rust.
        self._decode = tokenizer.decode
        self.tokens: list[int] = []
        self._prefix = 0  # tokens before this one are context only, their text shown
        self._shown = 0  # characters of the window's text (tokens from _prefix on) shown
        self._pending = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        text = self._window_text()
        self._show(_settled(text))
        if len(self.tokens) - self._prefix >= 2 * _CONTEXT:
            # What is held comes from the last 3 tokens' bytes, which a window of the
            # last _CONTEXT decodes alike. Sliding once every _CONTEXT tokens keeps the
            # second decode off most tokens.
            held = len(text) - self._shown
            self._prefix = len(self.tokens) - _CONTEXT
            self._shown = len(self._window_text()) - held

    def finalize(self) -> None:
        self._show(self._window_text())

    @property
    def last_segment(self) -> str:
        segment, self._pending = self._pending, ""
        return segment

    def _window_text(self) -> str:
        return self._decode(self.tokens[self._prefix :], skip_special_tokens=False)

    def _show(self, text: str) -> None:
        if len(text) > self._shown:
            self._pending += text[self._shown :]
            self._shown = len(text)


def _settled(text: str) -> str:
    """`text` without the replacement characters a character still incomplete may be."""
    held = min(len(text) - len(text.rstrip("\ufffd")), _MAX_HELD)
    return text[: len(text) - held]
