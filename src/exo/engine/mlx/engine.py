"""Generation with MLX: each step runs up to PREFILL_STEP prompt tokens of the requests
still prefilling (oldest first), then one batched forward that gives every decoding
request its next token (engine/mlx/batching.py), so new requests join and cancellations
land between steps and new prompts hold running streams up by one chunk at most.
Requests the batch cannot hold (images, caches other than plain KV) decode on their own
mlx-lm `generate_step` stream. Beyond MAX_BATCH requests, later ones wait in arrival
order. The model's text goes through the family's output parser, which splits reasoning
and tool calls from the answer."""

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, assert_never, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from pydantic import Field, TypeAdapter

from exo.engine.answer import AnswerStream, output_parser_for
from exo.engine.base import ConvertProgress, LayerProgress
from exo.engine.limits import DEFAULT_MAX_TOKENS, MAX_BATCH, PREFILL_STEP
from exo.engine.mlx.batching import DecodeBatch, can_batch
from exo.engine.mlx.chat_template import detected_think_markers, encode_prompt
from exo.engine.mlx.constrained import GrammarProcessor, grammar_for, grammar_tokenizer
from exo.engine.mlx.loading import load_shard
from exo.engine.mlx.parallel import broadcast_bytes, connect_group, inner_model, set_pipeline_sharing
from exo.engine.mlx.prefix_cache import PrefixCache
from exo.engine.mlx.vision import (
    VisionEncoder,
    VisionPrompt,
    attach_prompt_images,
    images_of,
    install_image_attention,
    load_vision,
    share_prompt,
)
from exo.engine.parsing.output import tool_format_for
from exo.shared.types.common import CommandId, FrozenModel, ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata
from exo.shared.types.text_generation import (
    ChatMessage,
    ChunkGenerated,
    GenerationStats,
    ImageInput,
    PrefillProgress,
    TextGenerationTaskParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)


class StartRequest(FrozenModel):
    op: Literal["start"] = "start"
    request_id: CommandId
    params: TextGenerationTaskParams
    seed: int
    # The response_format's grammar, compiled once by rank 0 and carried to the others.
    grammar: str | None = None


class CancelRequest(FrozenModel):
    op: Literal["cancel"] = "cancel"
    request_id: CommandId


class EndWarmup(FrozenModel):
    op: Literal["end_warmup"] = "end_warmup"


class StopFollowers(FrozenModel):
    op: Literal["shutdown"] = "shutdown"


# What rank 0 broadcasts before a step, for every rank to apply in the same order.
RankOp = Annotated[StartRequest | CancelRequest | EndWarmup | StopFollowers, Field(discriminator="op")]
_RANK_OPS = TypeAdapter(list[RankOp])


# The language model's inputs for positions [start, end) of a chunk, when they are more
# than its token ids (a prompt with images).
ChunkInputs = Callable[[int, int], dict[str, mx.array]]


def prefill_chunk(
    model: nn.Module, tokens: list[int], cache: list[Any], pipeline_ranks: int = 1, inputs: ChunkInputs | None = None
) -> None:
    """Run one chunk of the prompt through the model, filling the cache. We evaluate the
    hidden states, not just the caches as mlx-lm's own prefill does: on a pipeline rank
    the send to the next rank is not an input of any cache, so evaluating only caches
    would never send, and the ring would wait forever.

    Split by pipeline, the chunk goes through in a few micro-chunks without sharing the
    output: while rank 1 works on one, rank 0 is already on the next."""
    inner = inner_model(model)
    pieces = 1 if pipeline_ranks == 1 else 2 * pipeline_ranks
    size = max(1, -(-len(tokens) // pieces))
    with mx.stream(generation_stream):
        if pipeline_ranks > 1:
            set_pipeline_sharing(model, False)
        try:
            for start in range(0, len(tokens), size):
                end = min(start + size, len(tokens))
                if inputs is None:
                    hidden = inner(mx.array(tokens[start:end])[None], cache=cache)
                else:
                    hidden = inner(cache=cache, **inputs(start, end))
                mx.eval(hidden, [c.state for c in cache])
        finally:
            if pipeline_ranks > 1:
                set_pipeline_sharing(model, True)


def _without_prompt_token(processor: Any) -> Any:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(tokens[1:], logits) if len(tokens) > 1 else logits

    return process


@dataclass
class _Request:
    """One request: first its prompt is prefilled a chunk per step (so progress is
    reported and a cancellation lands between chunks on every rank), then it decodes a
    token per step."""

    request_id: CommandId
    prompt: list[int]
    cache: list[Any]
    sampler: Any
    answer: AnswerStream
    max_tokens: int
    submitted_at: float
    # What the prefix cache knows the prompt by (its images' hashes in their runs).
    key: list[int] = field(default_factory=list)
    vision: VisionPrompt | None = None
    want_logprobs: int | None = None  # None: none; else how many alternatives
    # logit_bias, penalties and a response_format grammar, applied in that order.
    logits_processors: list[Any] = field(default_factory=list)
    prefilled: int = 0
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    tokens: Iterator[tuple[mx.array, mx.array]] | None = None
    in_batch: bool = False  # decoding in the engine's DecodeBatch
    first_token_at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def prefilling(self) -> bool:
        # All but the last prompt token are prefilled; the last starts decoding.
        return self.prefilled < len(self.prompt) - 1

    @property
    def batchable(self) -> bool:
        return self.vision is None and can_batch(self.cache)


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
        self.model_type = ""
        self.reasoning_dialect = "none"
        self.tool_format: str | None = None
        self.think_markers: tuple[str, str] | None = None
        self.prefix_cache: PrefixCache | None = None
        self.vision: VisionEncoder | None = None
        # Its attention reads each request's images from its cache (3-D rotary positions,
        # bidirectional image attention).
        self.image_attention = False
        self.pipeline_ranks = 1
        self._requests: dict[CommandId, _Request] = {}
        # Image bytes rank 0 keeps back from the ops it broadcasts: only it runs the tower.
        self._held_images: dict[CommandId, list[ImageInput]] = {}
        # Requests of a split instance that could not start: ended at the next step.
        self._failed: list[ChunkGenerated] = []
        self._pending_ops: list[RankOp] = []
        self._grammar_tokenizer: Any = None
        self.shutdown_requested = False
        self._batch = DecodeBatch()

    @property
    def is_follower(self) -> bool:
        return self.group is not None and self.group.rank() > 0

    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        self.group = connect_group(instance, shard)

    def load(
        self,
        model_dir: Path,
        shard: ShardMetadata,
        on_layer_loaded: LayerProgress,
        on_converted: ConvertProgress | None = None,  # MLX loads the checkpoint as published
    ) -> None:
        self.model, self.tokenizer = load_shard(model_dir, shard, self.group, on_layer_loaded)
        self.model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
        self.tool_format = tool_format_for(self.model_type, self.tokenizer.chat_template)
        self.think_markers = detected_think_markers(self.tokenizer, self.model_type)
        self.prefix_cache = PrefixCache(self.model, self.model_type)
        # The tower runs on rank 0 alone; the other ranks get its features (share_prompt).
        self.vision = None if self.is_follower else load_vision(model_dir)
        if self.vision is not None:
            self.vision.bind(inner_model(self.model))
        first_layer = shard.start_layer if isinstance(shard, PipelineShardMetadata) else 0
        self.image_attention = install_image_attention(model_dir, inner_model(self.model), first_layer)
        self.pipeline_ranks = shard.world_size if isinstance(shard, PipelineShardMetadata) else 1
        self.card_defaults = shard.model_card.sampling_defaults.model_dump(exclude_none=True)
        self.reasoning_dialect = shard.model_card.reasoning_dialect.value

    def warm_up(self) -> int:
        if self.is_follower:
            # Step along with rank 0 until it says warm-up is over.
            generated = 0
            while True:
                ops = self._apply_ops()
                self._advance_all()
                if any(isinstance(op, EndWarmup) for op in ops):
                    return generated
                generated += 1
        params = TextGenerationTaskParams(
            model=ModelId("warmup"),
            messages=[ChatMessage(role="user", content="Hello")],
            max_tokens=4,
            temperature=0.0,
        )
        self.submit(CommandId("warmup"), params)
        generated = 0
        while self._requests or self._pending_ops:
            generated += sum(len(chunk.token_ids) for chunk in self.step())
        if self.group is not None:
            self._pending_ops.append(EndWarmup())
            self.step()
        return generated

    def submit(self, request_id: CommandId, params: TextGenerationTaskParams) -> None:
        assert self.model is not None and self.tokenizer is not None, "load() first"
        # An unusable schema fails here, back to the caller, not later inside a step.
        grammar = grammar_for(params.response_format)
        if params.images and self.vision is None:
            raise ValueError(f"{params.model} takes no images")
        missing = [image.sha256[:12] for image in params.images if not image.data_base64]
        if missing:
            raise ValueError(f"the bytes of image {', '.join(missing)} did not reach this node")
        # Every rank seeds its sampler the same way, so all ranks draw the same tokens.
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        if self.group is not None and params.images:
            self._held_images[request_id] = params.images
            params = params.model_copy(
                update={"images": [image.model_copy(update={"data_base64": ""}) for image in params.images]}
            )
        self._pending_ops.append(StartRequest(request_id=request_id, params=params, seed=seed, grammar=grammar))
        if self.group is None:
            self._apply_ops()

    def cancel(self, request_id: CommandId) -> None:
        self._pending_ops.append(CancelRequest(request_id=request_id))
        if self.group is None:
            self._apply_ops()

    def _agree_on_ops(self) -> list[RankOp]:
        ops, self._pending_ops = self._pending_ops, []
        if self.group is None:
            return ops
        payload = _RANK_OPS.dump_json(ops) if ops else None
        received = broadcast_bytes(None if self.is_follower else payload, self.group, generation_stream)
        return _RANK_OPS.validate_json(received) if received else []

    def _apply_ops(self) -> list[RankOp]:
        ops = self._agree_on_ops()
        for op in ops:
            match op:
                case StartRequest():
                    self._start_in_step(op)
                case CancelRequest(request_id=request_id):
                    self._requests.pop(request_id, None)
                    self._held_images.pop(request_id, None)
                case EndWarmup():
                    pass  # a follower's warm_up watches for it
                case StopFollowers():
                    self.shutdown_requested = True
                case _:
                    assert_never(op)
        return ops

    def _start_in_step(self, op: StartRequest) -> None:
        """A split instance starts requests inside a step, where an error would end the
        runner: it fails that request alone, the same on every rank (what only rank 0
        sees, its images, it shares before any rank can fail on it)."""
        if self.group is None:
            self._start(op)  # submit's caller fails the request
            return
        try:
            self._start(op)
        except Exception as error:
            self._requests.pop(op.request_id, None)
            self._held_images.pop(op.request_id, None)
            message = f"could not start generation: {error}"
            # A ValueError is the input's (a processor refusing an image); others are ours.
            failed = ChunkGenerated(
                command_id=op.request_id,
                finish_reason="error",
                error_message=message,
                rejected=isinstance(error, ValueError),
            )
            self._failed.append(failed)

    def _start(self, op: StartRequest) -> None:
        assert self.model is not None and self.tokenizer is not None
        params = op.params
        if op.grammar is not None and params.enable_thinking is None:
            # The grammar holds from the first token; a thinking block would swallow it.
            params = params.model_copy(update={"enable_thinking": False})
        prompt, prompt_text = encode_prompt(self.tokenizer, params, self.model_type, self.reasoning_dialect)
        if not prompt:
            prompt = [self.tokenizer.bos_token_id or 0]
        vision = self._vision_prompt(op.request_id, params, prompt)
        if vision is not None:
            prompt = vision.tokens
        key = vision.key if vision is not None else prompt
        mx.random.seed(op.seed)
        assert self.prefix_cache is not None
        # All but the last prompt token are prefilled; the last starts generate_step.
        cache, cached = self.prefix_cache.fetch(key[:-1])
        if self.image_attention:
            attach_prompt_images(cache, vision)
        max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
        self._requests[op.request_id] = _Request(
            request_id=op.request_id,
            prompt=prompt,
            cache=cache,
            sampler=self._sampler(params),
            answer=AnswerStream(
                op.request_id,
                self.tokenizer.detokenizer,
                output_parser_for(params, prompt_text, self.think_markers, self.tool_format),
                params.stop,
                self.tokenizer.eos_token_ids,
                max_tokens,
            ),
            max_tokens=max_tokens,
            submitted_at=time.perf_counter(),
            key=key,
            vision=vision,
            want_logprobs=(params.top_logprobs or 0) if params.logprobs else None,
            logits_processors=self._logits_processors(params, max_tokens, op.grammar),
            prefilled=cached,
            cached_tokens=cached,
        )

    def _vision_prompt(
        self, request_id: CommandId, params: TextGenerationTaskParams, prompt: list[int]
    ) -> VisionPrompt | None:
        if not params.images:
            return None
        held = self._held_images.pop(request_id, [])
        vision, failure = None, None
        if self.vision is not None:
            try:
                images = images_of(params, held)
                if isinstance(params.prompt, str):
                    prompt, images = self.vision.raw_prompt(self.tokenizer, params.prompt, images)
                vision = self.vision.prepare(prompt, images)
            except Exception as error:
                if self.group is None:
                    raise
                # The other ranks are about to wait for this prompt: they must hear of it.
                failure = str(error) or type(error).__name__
        if self.group is not None:
            vision = share_prompt(vision, self.group, generation_stream, failure)
        return vision

    def _logits_processors(self, params: TextGenerationTaskParams, max_tokens: int, grammar: str | None) -> list[Any]:
        assert self.tokenizer is not None
        # mlx-lm penalizes whatever it was fed, which starts with the last prompt token;
        # dropping that one makes the penalties count generated tokens only, as OpenAI's do.
        penalties = [
            _without_prompt_token(processor)
            for processor in make_logits_processors(
                repetition_penalty=self._pick(params, "repetition_penalty", None),
                repetition_context_size=max_tokens,
                presence_penalty=self._pick(params, "presence_penalty", None),
                presence_context_size=max_tokens,
                frequency_penalty=self._pick(params, "frequency_penalty", None),
                frequency_context_size=max_tokens,
            )
        ]
        # Out-of-range ids are dropped rather than refused: only the engine knows the
        # vocabulary, and MLX does not bounds-check the scatter that adds the bias.
        vocab = len(self.tokenizer._tokenizer)
        bias = {token: value for token, value in (params.logit_bias or {}).items() if 0 <= token < vocab}
        processors = make_logits_processors(logit_bias=bias) + penalties
        if grammar is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer._tokenizer, self.tokenizer.eos_token_ids)
            processors.append(GrammarProcessor(self._grammar_tokenizer, grammar))
        return processors

    def _pick(self, params: TextGenerationTaskParams, name: str, fallback: Any) -> Any:
        """The request's value, else the model card's recommendation, else `fallback`."""
        value = getattr(params, name)
        return value if value is not None else self.card_defaults.get(name, fallback)

    def _sampler(self, params: TextGenerationTaskParams):
        assert self.tokenizer is not None
        top_k = int(self._pick(params, "top_k", 0))
        # Keeping the whole vocabulary or more is no filter at all (and mlx-lm's would fail).
        if top_k >= len(self.tokenizer._tokenizer):
            top_k = 0
        return make_sampler(
            temp=float(self._pick(params, "temperature", 0.7)),
            top_p=float(self._pick(params, "top_p", 1.0)),
            min_p=float(self._pick(params, "min_p", 0.0)),
            top_k=top_k,
        )

    def step(self) -> list[ChunkGenerated]:
        if self.group is not None:
            self._apply_ops()
        failed, self._failed = self._failed, []
        return (failed if not self.is_follower else []) + self._advance_all()

    def _advance_all(self) -> list[ChunkGenerated]:
        """Every rank runs this on the same requests in the same order (arrival order,
        the admitted first), so the batch's rows and the collectives agree."""
        assert self.model is not None
        running = list(self._requests.values())[:MAX_BATCH]
        self._batch.keep_only(request.request_id for request in running if request.in_batch)
        chunks: list[ChunkGenerated] = []
        # At most PREFILL_STEP prompt tokens a step, oldest first: short prompts arriving
        # together all prefill in one step, a long one takes a chunk a step.
        budget = PREFILL_STEP
        for request in running:
            if budget > 0 and request.prefilling:
                before = request.prefilled
                chunks.append(self._prefill(request, budget))
                budget -= request.prefilled - before
        for request in running:
            if request.prefilling or request.in_batch:
                continue
            if request.batchable:
                last = request.prompt[-1]
                self._batch.join(
                    self.model, request.request_id, request.cache, last, request.sampler, request.logits_processors
                )
                request.in_batch = True
            else:
                chunks.append(self._decode_alone(request))
        for request_id, token, logprobs in self._batch.step():
            chunks.append(self._token_chunk(self._requests[request_id], token, logprobs))
        return chunks

    def _prefill(self, request: _Request, budget: int) -> ChunkGenerated:
        assert self.model is not None
        end = min(request.prefilled + budget, len(request.prompt) - 1)
        whole_runs = request.vision is not None and request.vision.whole_runs
        if request.vision is not None:
            end = request.vision.chunk_end(request.prefilled, end)
        prefill_chunk(
            self.model,
            request.prompt[request.prefilled : end],
            request.cache,
            # Micro-chunks would cut an image run that must be seen whole.
            1 if whole_runs else self.pipeline_ranks,
            self._chunk_inputs(request),
        )
        request.prefilled = end
        assert self.prefix_cache is not None
        self.prefix_cache.remember_boundary(request.key[:end], request.cache)
        return ChunkGenerated(
            command_id=request.request_id,
            prefill=PrefillProgress(processed_tokens=end, total_tokens=len(request.prompt)),
        )

    def _decode_alone(self, request: _Request) -> ChunkGenerated:
        assert self.model is not None
        if request.tokens is None:
            request.tokens = generate_step(
                mx.array(request.prompt[-1:]),
                self.model,
                max_tokens=request.max_tokens,
                sampler=request.sampler,
                logits_processors=request.logits_processors or None,
                prompt_cache=request.cache,
            )
        token_array, logprobs = next(request.tokens)
        token = cast(int, token_array.item()) if isinstance(token_array, mx.array) else int(token_array)
        return self._token_chunk(request, token, logprobs)

    def _token_chunk(self, request: _Request, token: int, logprobs: mx.array) -> ChunkGenerated:
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.output.append(token)
        logprob = None if request.want_logprobs is None else self._logprob(token, logprobs, request.want_logprobs)
        chunk = request.answer.feed(token, logprob)
        if chunk.finish_reason is None:
            return chunk
        del self._requests[request.request_id]
        cache = self._batch.leave(request.request_id) if request.in_batch else request.cache
        assert self.prefix_cache is not None
        self.prefix_cache.remember_finished(request.key + request.output, cache)
        return chunk.model_copy(update={"usage": self._usage(request), "stats": self._stats(request)})

    def _chunk_inputs(self, request: _Request) -> ChunkInputs | None:
        """For a prompt with images: the inputs of the chunk starting where prefill is."""
        prompt = request.vision
        if prompt is None:
            return None
        assert self.model is not None
        inner, offset = inner_model(self.model), request.prefilled
        return lambda start, end: prompt.chunk_inputs(inner, offset + start, offset + end)

    def _logprob(self, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
        """A token's log probability and its top alternatives. Extreme sampling settings
        (a repetition penalty near 0, say) can leave -inf or NaN, which JSON cannot carry;
        those become -9999.0, OpenAI's own floor for a token that cannot be picked."""
        assert self.tokenizer is not None
        alternatives = []
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            ids = cast(list[int], ids[mx.argsort(-logprobs[ids])].tolist())
            alternatives = [
                TopLogprob(token=self.tokenizer.decode([i]), token_id=i, logprob=_json_logprob(logprobs[i]))
                for i in ids
            ]
        return TokenLogprob(
            token=self.tokenizer.decode([token]),
            token_id=token,
            logprob=_json_logprob(logprobs[token]),
            top_logprobs=alternatives,
        )

    def _usage(self, request: _Request) -> Usage:
        return Usage(
            prompt_tokens=request.prompt_tokens,
            completion_tokens=request.answer.generated,
            reasoning_tokens=request.answer.reasoning_tokens,
            cached_tokens=request.cached_tokens,
        )

    def _stats(self, request: _Request) -> GenerationStats:
        now = time.perf_counter()
        first = request.first_token_at or now
        prefill_seconds = max(first - request.submitted_at, 1e-9)
        decode_seconds = max(now - first, 1e-9)
        return GenerationStats(
            prompt_tps=request.prompt_tokens / prefill_seconds,
            generation_tps=(request.answer.generated - 1) / decode_seconds if request.answer.generated > 1 else 0.0,
            prompt_tokens=request.prompt_tokens,
            generation_tokens=request.answer.generated,
            peak_memory_bytes=mx.get_peak_memory(),
        )

    @property
    def request_counts(self) -> tuple[int, int]:
        running = min(len(self._requests), MAX_BATCH)
        return running, len(self._requests) - running

    @property
    def has_work(self) -> bool:
        return bool(self._requests or self._pending_ops)

    def close(self) -> None:
        if self.group is not None and not self.is_follower:
            self._pending_ops.append(StopFollowers())
            self._apply_ops()
        self._requests.clear()
        self._batch = DecodeBatch()
        self.model = None
        self.tokenizer = None
        self.prefix_cache = None
        self.vision = None


def _json_logprob(value: mx.array) -> float:
    logprob = cast(float, value.item())
    return logprob if math.isfinite(logprob) else -9999.0
