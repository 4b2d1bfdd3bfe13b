"""Speculative decoding with a draft model on llama.cpp: a smaller model with the
target's tokenizer proposes its greedy continuation, which the target verifies in one
decode (the scheduler's verify rows), as engine/mlx/draft.py does on MLX. The draft has a
llama.cpp context of its own, one sequence per running request, cut back to the tokens
the target kept."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger
from transformers import AutoTokenizer

from exo.engine.llamacpp.gguf_convert import gguf_for
from exo.engine.llamacpp.native import Context, Model
from exo.engine.llamacpp.support import gguf_cache_dir
from exo.engine.speculative import CountedProposals, guesses_kept
from exo.shared.types.text_generation import Speculative


@dataclass
class DraftModel:
    model: Model
    context: Context
    model_id: str
    free_sequences: list[int]

    def close(self) -> None:
        self.context.close()
        self.model.close()


def load_draft(
    model_dir: Path, model_id: str, tokenizer: Any, n_ctx: int, sequences: int, batch_tokens: int, f32_kv: bool
) -> DraftModel:
    """The draft at `model_dir` in a context of `sequences` sequences; a ValueError when its
    tokenizer is not the target's (its proposals would be other tokens' ids)."""
    if AutoTokenizer.from_pretrained(model_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft model {model_id} has another tokenizer than the model it drafts for")
    model = Model(gguf_for(model_dir, gguf_cache_dir()))
    context = Context(model, n_ctx, sequences, batch_tokens, f32_kv=f32_kv)
    return DraftModel(model, context, model_id, list(range(sequences - 1, -1, -1)))


@dataclass
class DraftProposals(CountedProposals):
    """One request's proposals from the draft model (a Proposer). Its sequence in the
    draft's context is taken at its first proposal (a queued request holds none) and
    given back at close."""

    settings: Speculative
    draft: DraftModel
    sequence: int | None = None
    # The sequence holds tokens[:confirmed] and then `guesses` (the draft's own last
    # proposals, of which the target may since have kept some).
    confirmed: int = 0
    guesses: list[int] = field(default_factory=list)

    def close(self) -> None:
        if self.sequence is not None:
            self.draft.context.remove(self.sequence)
            self.draft.free_sequences.append(self.sequence)
            self.sequence = None

    def propose(self, most: int) -> list[int]:
        most = min(most, self.settings.num_draft)
        if most <= 0:
            return []
        if self.sequence is None:
            if not self.draft.free_sequences:
                return []
            self.sequence = self.draft.free_sequences.pop()
        self._drop_rejected_guesses()
        pending = self.tokens[self.confirmed :]
        if not pending:
            return []
        capacity = self.draft.context.batch.capacity
        for start in range(0, len(pending), capacity):
            logits = self._decode(pending[start : start + capacity], self.confirmed + start)
            if logits is None:
                return []
        self.confirmed = len(self.tokens)
        proposals: list[int] = []
        while True:
            token = int(np.argmax(logits))
            proposals.append(token)
            if len(proposals) == most:
                return proposals
            logits = self._decode([token], self.confirmed + len(self.guesses))
            if logits is None:
                return proposals
            self.guesses.append(token)

    def _decode(self, tokens: list[int], position: int) -> np.ndarray | None:
        """The logits after `tokens` fed at `position`; None when the draft's context has
        no room (its sequence is emptied: the next proposal starts from the whole sequence)."""
        context = self.draft.context
        assert self.sequence is not None
        context.batch.clear()
        index = context.batch.add(tokens, position, self.sequence, 1)
        if context.decode() != 0:
            logger.warning(f"draft {self.draft.model_id}: no room in its context; proposing nothing this step")
            context.remove(self.sequence)
            self.confirmed, self.guesses = 0, []
            return None
        return context.logits(index)

    def _drop_rejected_guesses(self) -> None:
        """Keep the guesses the sequence kept; remove the rest from the draft's KV."""
        kept = guesses_kept(self.guesses, self.tokens[self.confirmed :])
        rejected = len(self.guesses) - kept
        self.confirmed += kept
        self.guesses = []
        if rejected:
            assert self.sequence is not None
            self.draft.context.remove(self.sequence, self.confirmed, -1)
