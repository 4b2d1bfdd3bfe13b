"""Generation with MLX: one mlx-lm `generate_step` stream per request, advanced a token
at a time so new requests and cancellations are picked up between tokens."""

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

from exo.engine.base import LayerProgress
from exo.engine.mlx.chat_template import encode_prompt
from exo.engine.mlx.loading import load_shard
from exo.engine.mlx.parallel import broadcast_bytes, connect_group, inner_model
from exo.engine.stop_sequences import StopSequenceFilter
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import (
    ChatMessage,
    ChunkGenerated,
    GenerationStats,
    TextGenerationTaskParams,
    Usage,
)

DEFAULT_MAX_TOKENS = 1024
PREFILL_STEP = 512


def prefill(model: nn.Module, tokens: list[int], cache: list[Any]) -> None:
    """Run the prompt through the model in chunks, filling the cache. We evaluate the
    hidden states, not just the caches as mlx-lm's own prefill does: on a pipeline rank
    the send to the next rank is not an input of any cache, so evaluating only caches
    would never send, and the ring would wait forever."""
    inner = inner_model(model)
    with mx.stream(generation_stream):
        for start in range(0, len(tokens), PREFILL_STEP):
            hidden = inner(mx.array(tokens[start : start + PREFILL_STEP])[None], cache=cache)
            mx.eval(hidden, [c.state for c in cache])


def generate_tokens(
    model: nn.Module, prompt: list[int], max_tokens: int, sampler: Any
) -> Iterator[tuple[mx.array, mx.array]]:
    """mlx-lm's generate_step after our own prefill of all but the last prompt token.
    Lazy: the prefill runs on the first next()."""
    cache = make_prompt_cache(model)
    prefill(model, prompt[:-1], cache)
    yield from generate_step(mx.array(prompt[-1:]), model, max_tokens=max_tokens, sampler=sampler, prompt_cache=cache)


@dataclass
class _Request:
    request_id: str
    tokens: Iterator[tuple[mx.array, mx.array]]
    detokenizer: StreamingDetokenizer
    stop_filter: StopSequenceFilter
    max_tokens: int
    prompt_tokens: int
    submitted_at: float
    first_token_at: float | None = None
    generated: int = 0


class MlxEngine:
    """With several ranks, rank 0 alone takes requests and cancellations; before every
    step it broadcasts what changes (start these requests with these params and seeds,
    cancel those), and every rank applies the same changes and steps the same requests.
    So all ranks run the same collectives in the same order and none waits forever."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.group: mx.distributed.Group | None = None
        self.card_defaults: dict[str, float | int] = {}
        self._requests: dict[str, _Request] = {}
        self._pending_ops: list[dict[str, Any]] = []
        self.shutdown_requested = False

    @property
    def is_follower(self) -> bool:
        return self.group is not None and self.group.rank() > 0

    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        self.group = connect_group(instance, shard)

    def load(self, model_dir: Path, shard: ShardMetadata, on_layer_loaded: LayerProgress) -> None:
        self.model, self.tokenizer = load_shard(model_dir, shard, self.group, on_layer_loaded)
        self.card_defaults = shard.model_card.sampling_defaults.model_dump(exclude_none=True)

    def warm_up(self) -> int:
        if self.is_follower:
            # Step along with rank 0 until it says warm-up is over.
            generated = 0
            while not self._step_and_check("end_warmup"):
                generated += 1
            return generated
        params = TextGenerationTaskParams(
            model=ModelId("warmup"),
            messages=[ChatMessage(role="user", content="Hello")],
            max_tokens=4,
            temperature=0.0,
        )
        self.submit("warmup", params)
        generated = 0
        while self._requests or self._pending_ops:
            generated += sum(len(chunk.token_ids) for chunk in self.step())
        if self.group is not None:
            self._pending_ops.append({"op": "end_warmup"})
            self.step()
        return generated

    def submit(self, request_id: str, params: TextGenerationTaskParams) -> None:
        assert self.model is not None and self.tokenizer is not None, "load() first"
        # Every rank seeds its sampler the same way, so all ranks draw the same tokens.
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        self._pending_ops.append(
            {"op": "start", "id": request_id, "params": params.model_dump(mode="json"), "seed": seed}
        )
        if self.group is None:
            self._apply_ops()

    def cancel(self, request_id: str) -> None:
        self._pending_ops.append({"op": "cancel", "id": request_id})
        if self.group is None:
            self._apply_ops()

    def _agree_on_ops(self) -> list[dict[str, Any]]:
        ops, self._pending_ops = self._pending_ops, []
        if self.group is None:
            return ops
        payload = json.dumps(ops).encode() if ops else None
        received = broadcast_bytes(None if self.is_follower else payload, self.group, generation_stream)
        return json.loads(received) if received else []

    def _apply_ops(self) -> list[str]:
        applied = []
        for op in self._agree_on_ops():
            applied.append(op["op"])
            match op["op"]:
                case "start":
                    params = TextGenerationTaskParams.model_validate(op["params"])
                    self._start(op["id"], params, op["seed"])
                case "cancel":
                    self._requests.pop(op["id"], None)
                case "shutdown":
                    self.shutdown_requested = True
        return applied

    def _start(self, request_id: str, params: TextGenerationTaskParams, seed: int) -> None:
        assert self.model is not None and self.tokenizer is not None
        prompt = encode_prompt(self.tokenizer, params)
        mx.random.seed(seed)
        max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
        self._requests[request_id] = _Request(
            request_id=request_id,
            tokens=generate_tokens(self.model, prompt, max_tokens, self._sampler(params)),
            detokenizer=self.tokenizer.detokenizer,
            stop_filter=StopSequenceFilter(params.stop),
            max_tokens=max_tokens,
            prompt_tokens=len(prompt),
            submitted_at=time.perf_counter(),
        )

    def _step_and_check(self, marker: str) -> bool:
        applied = self._apply_ops()
        self._advance_all()
        return marker in applied

    def _sampler(self, params: TextGenerationTaskParams):
        def pick(name: str, fallback: float | int) -> float | int:
            value = getattr(params, name)
            return value if value is not None else self.card_defaults.get(name, fallback)

        return make_sampler(
            temp=float(pick("temperature", 0.7)),
            top_p=float(pick("top_p", 1.0)),
            min_p=float(pick("min_p", 0.0)),
            top_k=int(pick("top_k", 0)),
        )

    def step(self) -> list[ChunkGenerated]:
        if self.group is not None:
            self._apply_ops()
        return self._advance_all()

    def _advance_all(self) -> list[ChunkGenerated]:
        return [self._advance(request) for request in list(self._requests.values())]

    def _advance(self, request: _Request) -> ChunkGenerated:
        assert self.tokenizer is not None
        token_array, _ = next(request.tokens)
        token = int(token_array.item()) if isinstance(token_array, mx.array) else int(token_array)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.generated += 1
        finish_reason = None
        if token in self.tokenizer.eos_token_ids:
            finish_reason = "stop"
        else:
            request.detokenizer.add_token(token)
            if request.generated >= request.max_tokens:
                finish_reason = "length"
        if finish_reason is not None:
            request.detokenizer.finalize()
        text, stopped = request.stop_filter.feed(request.detokenizer.last_segment)
        if stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += request.stop_filter.flush()
        chunk = ChunkGenerated(
            command_id=CommandId(request.request_id),
            text=text,
            token_ids=[token],
            finish_reason=finish_reason,
        )
        if finish_reason is None:
            return chunk
        del self._requests[request.request_id]
        return chunk.model_copy(update={"usage": self._usage(request), "stats": self._stats(request)})

    def _usage(self, request: _Request) -> Usage:
        return Usage(prompt_tokens=request.prompt_tokens, completion_tokens=request.generated)

    def _stats(self, request: _Request) -> GenerationStats:
        now = time.perf_counter()
        first = request.first_token_at or now
        prefill_seconds = max(first - request.submitted_at, 1e-9)
        decode_seconds = max(now - first, 1e-9)
        return GenerationStats(
            prompt_tps=request.prompt_tokens / prefill_seconds,
            generation_tps=(request.generated - 1) / decode_seconds if request.generated > 1 else 0.0,
            prompt_tokens=request.prompt_tokens,
            generation_tokens=request.generated,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._requests or self._pending_ops)

    def close(self) -> None:
        if self.group is not None and not self.is_follower:
            self._pending_ops.append({"op": "shutdown"})
            self._apply_ops()
        self._requests.clear()
        self.model = None
        self.tokenizer = None
