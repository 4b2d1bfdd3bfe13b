"""Speculative decoding with a draft model on MLX: a smaller model with the target's
tokenizer proposes its greedy continuation, which the target verifies in one forward
(the scheduler's verify rows). As mlx-lm's speculative_generate_step, the draft keeps a
KV cache of its own per request, cut back to the tokens the target kept.

The draft runs on rank 0 alone (where it was placed); on a split, rank 0 sends each
proposal to the other ranks, which verify it with rank 0 in lockstep."""

import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from exo.engine.mlx.parallel import broadcast_bytes
from exo.engine.speculative import CountedProposals, Proposer, guesses_kept
from exo.shared.types.text_generation import Speculative

# The prompt goes into the draft's cache this many tokens a forward.
DRAFT_PREFILL_CHUNK = 512


@dataclass
class DraftModel:
    model: nn.Module
    model_id: str


def load_draft(model_dir: Path, model_id: str, tokenizer: TokenizerWrapper) -> DraftModel:
    """The draft at `model_dir`; a ValueError when its tokenizer is not the target's
    (its proposals would be other tokens' ids)."""
    draft_tokenizer = load_tokenizer(model_dir)
    if draft_tokenizer._tokenizer.get_vocab() != tokenizer._tokenizer.get_vocab():
        raise ValueError(f"draft model {model_id} has another tokenizer than the model it drafts for")
    model, _ = load_model(model_dir, lazy=False)
    return DraftModel(model, model_id)


@dataclass
class DraftProposals(CountedProposals):
    """One request's proposals from the draft model (a Proposer)."""

    settings: Speculative
    draft: DraftModel
    cache: list[Any] = field(default_factory=list)
    # The draft's cache holds tokens[:confirmed] and then `guesses` (its own last
    # proposals, of which the sequence may since have kept some).
    confirmed: int = 0
    guesses: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache = make_prompt_cache(self.draft.model)

    def close(self) -> None:
        self.cache = []  # the finished request's draft KV goes now, not when its Request does

    def propose(self, most: int) -> list[int]:
        most = min(most, self.settings.num_draft)
        if most <= 0:
            return []
        self._drop_rejected_guesses()
        pending = self.tokens[self.confirmed :]
        if not pending:
            return []
        proposals: list[int] = []
        with mx.stream(generation_stream):
            chunks = [
                pending[start : start + DRAFT_PREFILL_CHUNK] for start in range(0, len(pending), DRAFT_PREFILL_CHUNK)
            ]
            for chunk in chunks:
                logits = self.draft.model(mx.array(chunk)[None], cache=self.cache)
                mx.eval(logits)
            self.confirmed = len(self.tokens)
            while True:
                token = cast(int, mx.argmax(logits[0, -1]).item())
                proposals.append(token)
                if len(proposals) == most:
                    break
                logits = self.draft.model(mx.array([[token]]), cache=self.cache)
                self.guesses.append(token)
        return proposals

    def _drop_rejected_guesses(self) -> None:
        """Keep the guesses the sequence kept; cut the cache back past the rest."""
        kept = guesses_kept(self.guesses, self.tokens[self.confirmed :])
        rejected = len(self.guesses) - kept
        self.confirmed += kept
        self.guesses = []
        if rejected == 0:
            return
        if can_trim_prompt_cache(self.cache):
            trim_prompt_cache(self.cache, rejected)
        else:  # a sliding window that wrapped: start again from the whole sequence
            self.cache = make_prompt_cache(self.draft.model)
            self.confirmed = 0


@dataclass
class SharedProposals:
    """A split's proposals for one request: rank 0 asks its `source` (the draft runs
    there alone) and sends them; every other rank, with no source, receives them. Every
    rank's scheduler asks at the same point of the same step, so the sends pair up."""

    source: Proposer | None
    group: mx.distributed.Group
    stream: Any
    proposed: int = 0
    accepted: int = 0

    def extend(self, tokens: list[int]) -> None:
        if self.source is not None:
            self.source.extend(tokens)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if self.source is not None:
            self.source.record(proposed, accepted)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def propose(self, most: int) -> list[int]:
        tokens = array.array("i", self.source.propose(most) if self.source is not None else [])
        payload = broadcast_bytes(tokens.tobytes() if self.source is not None else None, self.group, self.stream)
        return array.array("i", payload).tolist()
