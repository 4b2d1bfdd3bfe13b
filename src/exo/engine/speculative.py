"""Speculative decoding: where proposals come from, and which a request gets.

Prompt lookup proposes the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (longest n first), in the prompt and the answer so far. No second
model: an answer that copies from its prompt (an edited file, a quoted passage) is
proposed whole runs at a time. A draft model (an engine's own, e.g. engine/mlx/draft.py)
proposes its greedy continuation.

The engine verifies a proposal in one forward over the last token and the proposed ones
and keeps the proposals up to the first that the request's own sampler does not draw:
at each position it draws as plain decoding would (one draw per token, the same sampler,
penalties and grammar), and a proposal is kept when it is that draw. So greedy answers are
the plain ones, and sampled answers follow the model's distribution exactly."""

from dataclasses import dataclass, field
from typing import Protocol

from exo.shared.types.text_generation import Speculative, TextGenerationTaskParams

# n-grams matched, longest first; a single token matches too often to be worth a verify.
MAX_NGRAM = 3
MIN_NGRAM = 2


class Proposer(Protocol):
    """One request's source of proposals, told every token of its sequence as it comes."""

    proposed: int
    accepted: int

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, most: int) -> list[int]:
        """Up to `most` tokens to follow the sequence so far."""
        ...

    def record(self, proposed: int, accepted: int) -> None: ...

    def close(self) -> None:
        """The request ended: what it held (a draft model's cache or sequence) is freed."""
        ...


def speculative_settings(params: TextGenerationTaskParams, card_default: Speculative | None) -> Speculative | None:
    """The request's own setting; else its model card's default."""
    if params.speculative == "off":
        return None
    return params.speculative if params.speculative is not None else card_default


def guesses_kept(guesses: list[int], tokens: list[int]) -> int:
    """How many of a draft's guesses, fed to its cache past the sequence it had, the
    sequence's `tokens` since then begin with."""
    kept = 0
    for guess, token in zip(guesses, tokens, strict=False):
        if guess != token:
            break
        kept += 1
    return kept


def check_draft(settings: Speculative, draft_id: str | None) -> None:
    """A ValueError unless the instance has a draft model, the one the request names if any."""
    if draft_id is None:
        raise ValueError(
            "speculative method 'draft' needs a draft model: this instance was placed without one "
            "(name it in the placement's draft_model or on the model's card)"
        )
    if settings.draft_model not in (None, draft_id):
        raise ValueError(
            f"this instance drafts with {draft_id}, not {settings.draft_model}: "
            "place the model again with that draft_model"
        )


@dataclass
class CountedProposals:
    """What every Proposer keeps: its sequence's tokens, and its proposals counted."""

    tokens: list[int] = field(default_factory=list, kw_only=True)
    proposed: int = field(default=0, kw_only=True)
    accepted: int = field(default=0, kw_only=True)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted

    def close(self) -> None:
        pass


@dataclass
class PromptLookup(CountedProposals):
    """An index of the sequence's n-grams to where each last occurred (the position
    after it), kept as tokens arrive."""

    settings: Speculative
    _ends: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # The n-grams ending at the current end become "earlier" once a token follows.
            end = len(self.tokens)
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, most: int) -> list[int]:
        """Up to `most` tokens that followed the longest n-gram ending the sequence."""
        most = min(most, self.settings.num_draft)
        if most <= 0:
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(self.tokens) < n:
                continue
            end = self._ends.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end : end + most]
        return []
