"""Continuous batching of decode: every request whose prompt is prefilled decodes in one
batched forward per step, on mlx-lm's `GenerationBatch` over its batched KV cache
(`BatchKVCache`, left-padded, one row per request). A request joins between steps with
the cache its own prefill filled, and leaves at once when it finishes or is cancelled;
a finished one's cache is extracted for the prefix cache.

Each row keeps its own sampler and logits processors (mlx-lm applies them per row);
stop strings, EOS, max tokens and logprobs stay with the engine, which decides when a
request finishes. mlx-lm's own stop and length checks are switched off (no stop
sequences, a max that is never reached) so the batch's membership is the engine's alone:
on a split instance every rank then keeps the same rows in the same order."""

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import KVCache

from exo.shared.types.common import CommandId

# Requests prefilling or decoding at once on an instance; later ones wait in arrival order.

_NEVER = 1 << 62  # mlx-lm's per-row max_tokens: the engine finishes requests itself


def can_batch(cache: list[Any]) -> bool:
    """Plain KV caches only, for now: rotating windows, SSM state and DeepSeek V4's
    compressed caches decode on their own (mlx-lm batches some of them, untested here)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


class DecodeBatch:
    def __init__(self) -> None:
        self._batch: GenerationBatch | None = None
        self._uids: dict[CommandId, int] = {}
        self._next_uid = 0

    def __contains__(self, request_id: CommandId) -> bool:
        return request_id in self._uids

    def __len__(self) -> int:
        return len(self._uids)

    def join(
        self,
        model: nn.Module,
        request_id: CommandId,
        cache: list[Any],
        last_token: int,
        sampler: Any,
        processors: list[Any],
    ) -> None:
        """`cache` holds the prompt but its last token, which the request's first step feeds
        (computed here, on its own; its token comes out of the next `step`)."""
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        with mx.stream(generation_stream):
            joined = GenerationBatch(
                model,
                [uid],
                mx.array([last_token]),
                [layer.merge([layer]) for layer in cache],
                # The processors' context starts at the last prompt token, as generate_step's does.
                [[]],
                [sampler],
                sampler,
                [list(processors)],
                [StopSequences()],
                [_NEVER],
            )
            if self._batch is None or len(self._batch) == 0:
                self._batch = joined
            else:
                self._batch.extend(joined)
        self._uids[request_id] = uid

    def step(self) -> list[tuple[CommandId, int, mx.array]]:
        """One batched forward: each member's next token and its log-probabilities."""
        if self._batch is None or not self._uids:
            return []
        by_uid = {uid: request_id for request_id, uid in self._uids.items()}
        with mx.stream(generation_stream):
            responses = self._batch.next()
        return [(by_uid[response.uid], response.token, response.logprobs) for response in responses]

    def leave(self, request_id: CommandId) -> list[Any]:
        """Take the request out; returns its cache (the prompt and every token fed so far)."""
        assert self._batch is not None
        uid = self._uids.pop(request_id)
        index = self._batch.uids.index(uid)
        with mx.stream(generation_stream):
            cache = self._batch.extract_cache(index)
            self._batch.filter([i for i in range(len(self._batch)) if i != index])
        return cache

    def keep_only(self, request_ids: Iterable[CommandId]) -> None:
        """Drop members no longer wanted (cancelled): their caches go with them."""
        wanted = set(request_ids)
        gone = [request_id for request_id in self._uids if request_id not in wanted]
        if not gone or self._batch is None:
            return
        for request_id in gone:
            del self._uids[request_id]
        keep_uids = set(self._uids.values())
        with mx.stream(generation_stream):
            self._batch.filter([i for i, uid in enumerate(self._batch.uids) if uid in keep_uids])
