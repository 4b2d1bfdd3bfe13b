"""Choosing each next token from llama.cpp's logits, in numpy, as mlx-lm's samplers and
logits processors do for the MLX engine: logit bias, then repetition, presence and
frequency penalties over the generated tokens, then the JSON grammar's mask; log
probabilities of the result; then greedy, or top_p, min_p and top_k filters and a draw
at the temperature from the request's own seeded generator.

Greedy decoding with nothing to apply and no logprobs asked is one argmax over
llama.cpp's buffer: no copy, no softmax."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exo.engine.constrained import GrammarMask
from exo.shared.types.text_generation import TokenLogprob, TopLogprob


@dataclass
class Sampler:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarMask | None = None
    seed: int = 0
    # How often each generated token came: what the penalties count.
    counts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self._bias_ids = np.array(list(self.bias), dtype=np.int64)
        self._bias_values = np.array(list(self.bias.values()), dtype=np.float32)
        self._penalized = any(
            value is not None and value != 0
            for value in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )
        self._processed = bool(self.bias) or self._penalized or self.grammar is not None

    def choose(self, logits: np.ndarray, want_logprobs: bool) -> tuple[int, np.ndarray | None]:
        """The next token, and the log probabilities it was chosen from (when asked)."""
        if not self._processed and self.temperature == 0 and not want_logprobs:
            return int(np.argmax(logits)), None
        values = self._process(logits) if self._processed else logits
        if self.temperature == 0 and not want_logprobs:
            return int(np.argmax(values)), None
        logprobs = _log_softmax(values)
        if self.temperature == 0:
            return int(np.argmax(logprobs)), logprobs
        return self._draw(logprobs), logprobs if want_logprobs else None

    def accept(self, token: int) -> None:
        """Records a generated token (penalties count it, the grammar consumes it)."""
        if self._penalized:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.grammar is not None:
            self.grammar.consume([token])

    def _process(self, logits: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return self._apply(logits.astype(np.float32, copy=True))

    def _apply(self, values: np.ndarray) -> np.ndarray:
        if self.bias:
            np.add.at(values, self._bias_ids, self._bias_values)
        if self._penalized and self.counts:
            seen = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            if self.repetition_penalty:
                selected = values[seen]
                penalty = self.repetition_penalty
                values[seen] = np.where(selected < 0, selected * penalty, selected / penalty)
            if self.presence_penalty:
                values[seen] -= self.presence_penalty
            if self.frequency_penalty:
                times = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
                values[seen] -= self.frequency_penalty * times
        if self.grammar is not None:
            values[~self.grammar.allowed(len(values))] = -np.inf
        # An extreme penalty (5e-324, 1e300) turns logits into inf - inf.
        values[np.isnan(values)] = -np.inf
        return values

    def _draw(self, logprobs: np.ndarray) -> int:
        kept = logprobs
        if 0 < self.top_p < 1.0:
            kept = _top_p(kept, self.top_p)
        if self.min_p != 0.0:
            kept = np.where(kept < kept.max() + math.log(self.min_p), -np.inf, kept)
        if 0 < self.top_k < len(kept):
            cut = np.argpartition(-kept, self.top_k - 1)[self.top_k :]
            kept = kept.copy()
            kept[cut] = -np.inf
        scaled = kept * (1.0 / self.temperature)
        peak = scaled.max()
        if not np.isfinite(peak):
            return int(np.argmax(scaled))
        weights = np.exp(scaled - peak)
        cumulative = np.cumsum(weights, dtype=np.float64)
        return int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))


def _log_softmax(values: np.ndarray) -> np.ndarray:
    peak = values.max()
    if np.isposinf(peak):
        # Penalties can push logits to inf: those tokens share all the probability.
        top = values == peak
        return np.where(top, -np.log(top.sum()), -np.inf).astype(np.float32)
    shifted = values - peak
    return shifted - np.log(np.exp(shifted, dtype=np.float64).sum()).astype(np.float32)


def _top_p(logprobs: np.ndarray, top_p: float) -> np.ndarray:
    """mlx-lm's nucleus filter: drop the least likely tokens whose mass above is enough."""
    ascending = np.sort(logprobs)
    probs = np.exp(ascending.astype(np.float64))
    mass_above = np.cumsum(probs[::-1])[::-1] - probs
    total = mass_above[0] + probs[0]
    dropped = int((mass_above >= top_p * total).sum())
    threshold = ascending[min(dropped, len(ascending) - 1)]
    return np.where(logprobs < threshold, -np.inf, logprobs)


def token_logprob(decode: Callable[[list[int]], str], token: int, logprobs: np.ndarray, top: int) -> TokenLogprob:
    """A token's log probability and its `top` alternatives. -inf or NaN (a token the
    grammar or a penalty ruled out), which JSON cannot carry, become -9999.0, OpenAI's own
    floor for a token that cannot be picked."""
    alternatives = []
    if top > 0:
        ids = np.argpartition(-logprobs, top - 1)[:top]
        ids = ids[np.argsort(-logprobs[ids], kind="stable")]
        alternatives = [
            TopLogprob(token=decode([int(i)]), token_id=int(i), logprob=_json_float(logprobs[i])) for i in ids
        ]
    return TokenLogprob(
        token=decode([token]), token_id=token, logprob=_json_float(logprobs[token]), top_logprobs=alternatives
    )


def _json_float(value: Any) -> float:
    number = float(value)
    return number if math.isfinite(number) else -9999.0
