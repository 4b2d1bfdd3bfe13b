"""Streaming text from token ids with a Hugging Face tokenizer, MLX-free: each token's
text is what decoding the last few tokens adds to decoding them without it, so
byte-level pieces of one character, and SentencePiece's leading spaces, come out right.
Special tokens are text too (think markers, tool-call tags)."""

from typing import Any

# Tokens decoded again before the new one: enough context for a multi-byte character.
_CONTEXT = 6


class StreamingDetokenizer:
    """The interface of mlx-lm's detokenizers that exo reads: add_token, finalize and
    last_segment (the text since the last read)."""

    def __init__(self, tokenizer: Any) -> None:
        # A tokenizers.Tokenizer (a fast HF tokenizer's backend_tokenizer): its decode
        # is a direct call into Rust.
        self._decode = tokenizer.decode
        self.tokens: list[int] = []
        self._prefix = 0  # tokens before this one were shown and are context only
        self._read = 0  # tokens before this one are shown
        self._pending = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        shown = self._decode(self.tokens[self._prefix : self._read], skip_special_tokens=False)
        text = self._decode(self.tokens[self._prefix :], skip_special_tokens=False)
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            self._pending += text[len(shown) :]
            self._read = len(self.tokens)
            self._prefix = max(0, self._read - _CONTEXT)

    def finalize(self) -> None:
        shown = self._decode(self.tokens[self._prefix : self._read], skip_special_tokens=False)
        text = self._decode(self.tokens[self._prefix :], skip_special_tokens=False)
        self._pending += text[len(shown) :]
        self._read = len(self.tokens)

    @property
    def last_segment(self) -> str:
        segment, self._pending = self._pending, ""
        return segment
