"""Batching on mlx-lm's batched KV cache (`BatchKVCache`, one row per request): prompt
chunks of several requests prefilled in one forward (`prefill_together`), and decode,
where every request whose prompt is prefilled takes its next token in one batched
forward per step, on mlx-lm's `GenerationBatch`. Requests join between steps with the
cache their prefill filled (those that finish prefilling in the same step join in one
forward), and leave when they finish or are cancelled: a finished one's row is copied
out for the prefix cache, and the rows of those that left in a step are dropped together
after it (`settle`).

Each row keeps its own sampler and logits processors (mlx-lm applies them per row);
stop strings, EOS, max tokens and logprobs stay with the engine, which decides when a
request finishes. mlx-lm's own stop and length checks are switched off (no stop
sequences, a max that is never reached) so the batch's membership is the engine's alone:
on a split instance every rank then keeps the same rows in the same order."""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import KVCache

from exo.shared.types.common import CommandId

_NEVER = 1 << 62  # mlx-lm's per-row max_tokens: the engine finishes requests itself


def can_batch(cache: list[Any]) -> bool:
    """Plain KV caches only, for now: rotating windows, SSM state and DeepSeek V4's
    compressed caches decode on their own (mlx-lm batches some of them, untested here)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


@dataclass(frozen=True)
class Joiner:
    request_id: CommandId
    cache: list[Any]
    last_token: int
    sampler: Any
    processors: list[Any]


def _merged(caches: list[list[Any]]) -> list[Any]:
    """One batched cache per layer from the requests' own (left-padded to one length),
    which it takes: their lists are emptied. Evaluated now, so each layer's sources are
    freed as its copy is made: only one layer is ever held twice, where merging every
    layer before freeing any would hold the requests' whole KV twice (memory budget)."""
    merged = []
    for index in range(len(caches[0])):
        layers = [cache[index] for cache in caches]
        merged.append(layers[0].merge(layers))
        mx.eval(_arrays(merged[-1]))
        for cache in caches:
            cache[index] = None
    for cache in caches:
        cache.clear()
    return merged


def _arrays(layer: Any) -> list[mx.array]:
    """A plain or batched KV cache's arrays (none before its first token)."""
    return [array for array in (layer.keys, layer.values) if array is not None]


def forward_groups(chunks: list[tuple[int, int]], area: int | None, tokens: int | None) -> list[list[int]]:
    """A step's prompt chunks, given as (length, end), grouped in order into forwards:
    each a batch padded to one length, of at most `tokens` tokens (rows x its longest
    chunk) and whose attention (that x its deepest end) stays within `area` query-key
    pairs; a chunk alone always makes one (the scheduler sized it to fit). The indexes
    of each forward's chunks."""
    groups: list[list[int]] = []
    widest = deepest = 0
    for index, (length, end) in enumerate(chunks):
        wider, deeper = max(widest, length), max(deepest, end)
        padded = (len(groups[-1]) + 1) * wider if groups else 0
        if groups and (tokens is None or padded <= tokens) and (area is None or padded * deeper <= area):
            groups[-1].append(index)
            widest, deepest = wider, deeper
        else:
            groups.append([index])
            widest, deepest = length, end
    return groups


def prefill_together(model: nn.Module, caches: list[list[Any]], chunks: list[list[int]]) -> list[list[Any]]:
    """Several requests' prompt chunks in one forward: their caches merged into one
    batch (left-padded to one length), the chunks right-padded to one length, as
    mlx-lm's BatchGenerator prefills. Takes the requests' caches (their lists are
    emptied) and returns new ones, each holding its chunk."""
    lengths = [len(chunk) for chunk in chunks]
    longest = max(lengths)
    padding = [longest - length for length in lengths]
    with mx.stream(generation_stream):
        merged = _merged(caches)
        for layer in merged:
            layer.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([chunk + [0] * pad for chunk, pad in zip(chunks, padding, strict=True)])
        model(tokens, cache=merged)
        for layer in merged:
            layer.finalize()
        # Each layer's rows copied out, then the merged layer freed, one layer at a time;
        # nothing holds the merged batch past this step.
        filled: list[list[Any]] = [[] for _ in chunks]
        for index in range(len(merged)):
            for row, cache in enumerate(filled):
                cache.append(merged[index].extract(row))
            mx.eval([_arrays(cache[-1]) for cache in filled])
            merged[index] = None
        return filled


class DecodeBatch:
    def __init__(self) -> None:
        self._batch: GenerationBatch | None = None
        self._uids: dict[CommandId, int] = {}
        self._next_uid = 0
        # The caches of the requests that left since the last settle, still to be copied.
        self._leaving: list[list[Any]] = []

    def __contains__(self, request_id: CommandId) -> bool:
        return request_id in self._uids

    def __len__(self) -> int:
        return len(self._uids)

    def join(self, model: nn.Module, joiners: list[Joiner]) -> None:
        """Each joiner's cache holds its prompt but the last token, which its first step
        feeds: all of them in one forward, here; their tokens come out of the next `step`."""
        if not joiners:
            return
        uids = list(range(self._next_uid, self._next_uid + len(joiners)))
        self._next_uid += len(joiners)
        with mx.stream(generation_stream):
            joined = GenerationBatch(
                model,
                uids,
                mx.array([joiner.last_token for joiner in joiners]),
                _merged([joiner.cache for joiner in joiners]),
                # The processors' context starts at the last prompt token, as generate_step's does.
                [[] for _ in joiners],
                [joiner.sampler for joiner in joiners],
                joiners[0].sampler,
                [list(joiner.processors) for joiner in joiners],
                [StopSequences() for _ in joiners],
                [_NEVER] * len(joiners),
            )
            if self._batch is None or len(self._batch) == 0:
                self._batch = joined
            else:
                self.settle()
                self._batch.extend(joined)
                # Grown now, a layer at a time, with the joiners' copy held by nothing
                # else: each layer's old arrays are freed as its new ones are made, where
                # the next forward would hold the old and new batch whole at once.
                joined.prompt_cache = []
                for layer in self._batch.prompt_cache:
                    mx.eval(_arrays(layer))
        for joiner, uid in zip(joiners, uids, strict=True):
            self._uids[joiner.request_id] = uid

    def step(self) -> list[tuple[CommandId, int, mx.array]]:
        """One batched forward: each member's next token and its log-probabilities."""
        self.settle()
        if self._batch is None or not self._uids:
            return []
        by_uid = {uid: request_id for request_id, uid in self._uids.items()}
        with mx.stream(generation_stream):
            responses = self._batch.next()
        return [(by_uid[response.uid], response.token, response.logprobs) for response in responses]

    def leave(self, request_id: CommandId) -> list[Any]:
        """Take the request out; returns its cache (the prompt and every token fed so far),
        a copy of its row, computed by `settle` (the engine settles after each step and
        each cancellation)."""
        assert self._batch is not None
        uid = self._uids.pop(request_id)
        with mx.stream(generation_stream):
            cache = self._batch.extract_cache(self._batch.uids.index(uid))
        self._leaving.append(cache)
        return cache

    def settle(self) -> None:
        """The rows of the requests that left, copied out and dropped from the batch in one
        filter, a layer at a time: each layer's old arrays are freed as its copies and its
        filtered batch are made. Filtering at each leave, with each copy computed at once,
        copied the rest of the batch per request, and 8 requests finishing in one step
        held the batch's KV twice."""
        if self._batch is None or len(self._batch) == len(self._uids):
            return
        members = set(self._uids.values())
        leaving, self._leaving = self._leaving, []
        with mx.stream(generation_stream):
            self._batch.filter([index for index, uid in enumerate(self._batch.uids) if uid in members])
            kept = self._batch.prompt_cache
            for index in range(max((len(cache) for cache in leaving), default=0)):
                mx.eval([_arrays(cache[index]) for cache in leaving], _arrays(kept[index]) if kept else [])
        if not self._uids:
            self._batch = None
