"""Output constrained to JSON (OpenAI's response_format), with llguidance, MLX-free: the
schema becomes a grammar, and before each sampled token a mask forbids every token the
grammar cannot take next. EOS is allowed only once the JSON is complete, and is the only
choice once the grammar can take nothing more. Both engines mask with `GrammarMask`."""

import json
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf
import numpy as np


def grammar_for(response_format: dict[str, Any] | None) -> str | None:
    """The llguidance grammar for an OpenAI response_format, or None for plain text.
    Raises ValueError for an unknown type or a schema llguidance cannot compile."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema") if response_format else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format json_schema needs a json_schema object with a schema object")
        # No schema at all means any JSON value, as OpenAI takes it.
        schema = spec.get("schema") or {}
    else:
        raise ValueError(f"unknown response_format type {kind!r}")
    try:
        # Compact separators and no free whitespace: a model cannot wander off into
        # endless blank lines, and the answer stays short.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False}
        )
    except ValueError as error:
        raise ValueError(f"response_format schema is not usable: {error}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"response_format schema is not usable: {messages[0]}")
    return grammar


def grammar_tokenizer(hf_tokenizer: Any, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (about a second to build: keep it)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=sorted(eos_token_ids))


class GrammarMask:
    """One request's grammar state: `consume` each generated token, `allowed` before
    sampling the next one."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"response_format grammar failed: {self.matcher.get_error()}")
        self.eos = tokenizer.eos_token

    def consume(self, tokens: list[int]) -> None:
        if tokens:
            self.matcher.consume_tokens(tokens)

    def allowed(self, vocab: int) -> np.ndarray:
        """Which of the model's `vocab` logits may be sampled next (bool)."""
        allowed = np.zeros(vocab, dtype=bool)
        if self.matcher.is_stopped() or self.matcher.is_error():
            # Complete (or, should a token slip past the mask, broken): only EOS can follow.
            allowed[self.eos] = True
            return allowed
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        # The model's vocabulary can be padded past the tokenizer's, or be shorter.
        allowed[: min(vocab, len(bits))] = bits[:vocab].astype(bool)
        return allowed
