"""The JSON grammar (engine/constrained.py) as an mlx-lm logits processor."""

from typing import cast

import llguidance
import mlx.core as mx

from exo.engine.constrained import GrammarMask, grammar_for, grammar_tokenizer

__all__ = ["GrammarProcessor", "grammar_for", "grammar_tokenizer"]


class GrammarProcessor:
    """An mlx-lm logits processor: consumes the tokens generated since its last call, then
    sets every token the grammar forbids to -inf.

    mlx-lm hands it all the tokens fed to generate_step, the first being the last prompt
    token, which the grammar must not see. It reads them back from the device each step,
    so constrained decoding gives up mlx-lm's overlap of one step with the next."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.mask = GrammarMask(tokenizer, grammar)
        self._seen = 1  # the last prompt token

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = cast(list[int], tokens[self._seen :].tolist())
        self._seen = len(tokens)
        self.mask.consume(new)
        allowed = self.mask.allowed(logits.shape[-1])
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
