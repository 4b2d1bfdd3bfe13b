"""Generation with MLX, a backend of the engine-neutral scheduler (engine/scheduler.py),
which plans each step: the prompt chunks of the requests still prefilling go through
the model together in one forward (engine/mlx/batching.py, mlx-lm's batched cache), the
requests that finish prefilling join the decode batch together, and one batched forward
gives every decoding request its next token. Requests the batch cannot hold (images,
caches other than plain KV) prefill and decode on their own (mlx-lm's `generate_step`).
The model's text goes through the family's output parser, which splits reasoning and
tool calls from the answer."""

import copy
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, assert_never, cast

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine import limits
from exo.engine.answer import AnswerStream, output_parser_for
from exo.engine.base import ConvertProgress, LayerProgress, generate_warmup
from exo.engine.detokenizer import StreamingDetokenizer
from exo.engine.kv_handoff import Handoff, LayerPart, PartSink
from exo.engine.mlx.batching import DecodeBatch, Joiner, can_batch, forward_groups, prefill_together
from exo.engine.mlx.chat_template import detected_think_markers, encode_prompt
from exo.engine.mlx.constrained import GrammarProcessor, grammar_for, grammar_tokenizer
from exo.engine.mlx.draft import DraftModel, DraftProposals, SharedProposals, load_draft
from exo.engine.mlx.kv_transfer import KvAssembler, KvExporter
from exo.engine.mlx.loading import load_shard
from exo.engine.mlx.memory import (
    activation_bytes,
    device_memory,
    forward_area,
    kv_bytes_per_token,
    limit_buffer_cache,
    mlx_device,
    score_bytes_per_pair,
)
from exo.engine.mlx.parallel import (
    agree_on_minimum,
    collective_stream,
    connect_group,
    from_last_rank,
    inner_model,
)
from exo.engine.mlx.rank_ops import CancelRequest, EndWarmup, RankOp, StartRequest, StopFollowers, agree_on_ops
from exo.engine.mlx.vision import (
    VisionEncoder,
    VisionPrompt,
    attach_prompt_images,
    images_of,
    install_image_attention,
    load_vision,
    share_prompt,
)
from exo.engine.parsing.output import make_output_parser, tool_format_for
from exo.engine.prefix_cache import SavedKV
from exo.engine.request_settings import logprobs_wanted, max_tokens_of, sampling_settings
from exo.engine.scheduler import Budget, Request, Row, Sampled, Scheduler
from exo.engine.speculative import PromptLookup, Proposer, check_draft, speculative_settings
from exo.shared.types.common import CommandId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerMemory
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata
from exo.shared.types.text_generation import (
    ChunkGenerated,
    ImageInput,
    KvHandoffStats,
    Speculative,
    TextGenerationTaskParams,
    TokenLogprob,
    TopLogprob,
)

# The language model's inputs for positions [start, end) of a chunk, when they are more
# than its token ids (a prompt with images).
ChunkInputs = Callable[[int, int], dict[str, mx.array]]


def prefill_chunk(
    model: nn.Module,
    tokens: list[int],
    cache: list[Any],
    pipeline_ranks: int = 1,
    inputs: ChunkInputs | None = None,
    micro_chunks: bool = True,
) -> None:
    """Run one chunk of the prompt through the model, filling the cache. On one rank (or
    a tensor split, whose ranks all skip the same collectives) only the caches are
    evaluated, as mlx-lm's own prefill does: the last layer's attention output and MLP,
    and the final norm, feed nothing a cache holds (on a 2-layer model, half the work).
    On a pipeline rank the hidden states are evaluated too: the send to the next rank is
    not an input of any cache, so evaluating only caches would never send, and the ring
    would wait forever.

    Split by pipeline, the chunk goes through in a few micro-chunks (unless
    `micro_chunks` is off, where one would cut an image run that must be seen whole):
    while rank 1 works on one, rank 0 is already on the next."""
    inner = inner_model(model)
    pieces = 2 * pipeline_ranks if pipeline_ranks > 1 and micro_chunks else 1
    size = max(1, -(-len(tokens) // pieces))
    with mx.stream(generation_stream):
        for start in range(0, len(tokens), size):
            end = min(start + size, len(tokens))
            if inputs is None:
                hidden = inner(mx.array(tokens[start:end])[None], cache=cache)
            else:
                hidden = inner(cache=cache, **inputs(start, end))
            mx.eval(hidden if pipeline_ranks > 1 else [], [c.state for c in cache])


def _without_prompt_token(processor: Any) -> Any:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(tokens[1:], logits) if len(tokens) > 1 else logits

    return process


@dataclass
class _Work:
    """A request's part on MLX: its sampler and logits processors (logit_bias, penalties
    and a response_format grammar, in that order), its images, and its cache while it
    prefills or decodes on its own."""

    sampler: Any
    logits_processors: list[Any]
    vision: VisionPrompt | None = None
    cache: list[Any] = field(default_factory=list)  # empty while in the batch
    tokens: Iterator[tuple[mx.array, mx.array]] | None = None  # decoding on its own
    in_batch: bool = False  # decoding in the engine's DecodeBatch
    # Decoding speculatively: verified on its own, with the tokens fed since its prompt
    # (as mlx-lm's generate_step keeps them for the logits processors).
    speculative: bool = False
    greedy: bool = False
    history: list[int] = field(default_factory=list)
    # Prefilled for another engine: what each chunk adds goes to it.
    export: KvExporter | None = None

    @property
    def batchable(self) -> bool:
        return self.vision is None and not self.speculative and can_batch(self.cache)


class MlxEngine:
    """With several ranks, rank 0 alone takes requests and cancellations; before every
    step it broadcasts what changes (start these requests with these params and seeds,
    cancel those), and every rank applies the same changes to its scheduler and steps
    the same requests. So all ranks run the same collectives in the same order and none
    waits forever."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.group: mx.distributed.Group | None = None
        self.config: dict[str, Any] = {}
        self.card_defaults: dict[str, float | int] = {}
        self.card_speculative: Speculative | None = None
        self.draft: DraftModel | None = None
        self.model_type = ""
        self.reasoning_dialect = "none"
        self.tool_format: str | None = None
        self.think_markers: tuple[str, str] | None = None
        self.scheduler: Scheduler | None = None
        self.vision: VisionEncoder | None = None
        # Its attention reads each request's images from its cache (3-D rotary positions,
        # bidirectional image attention).
        self.image_attention = False
        self.pipeline_ranks = 1
        # Image bytes rank 0 keeps back from the ops it broadcasts: only it runs the tower.
        self._held_images: dict[CommandId, list[ImageInput]] = {}
        # Requests of a split instance that could not start: ended at the next step.
        self._failed: list[ChunkGenerated] = []
        self._pending_ops: list[RankOp] = []
        self._grammar_tokenizer: Any = None
        # One sampler per setting: rows sharing one sample in one call.
        self._samplers: dict[tuple[float, float, float, int], Any] = {}
        self.shutdown_requested = False
        self._batch = DecodeBatch()
        # What moving the KV of requests prefilled elsewhere took, until they start.
        self._handoff_stats: dict[CommandId, KvHandoffStats] = {}

    @property
    def is_follower(self) -> bool:
        return self.group is not None and self.group.rank() > 0

    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        self.group = connect_group(instance, shard)
        # Taken in the thread that steps: MLX's default streams are per thread.
        self.collective_stream = collective_stream(generation_stream)

    def load(
        self,
        model_dir: Path,
        shard: ShardMetadata,
        on_layer_loaded: LayerProgress,
        on_converted: ConvertProgress | None = None,  # MLX loads the checkpoint as published
    ) -> None:
        self.model, self.tokenizer = load_shard(model_dir, shard, self.group, on_layer_loaded)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.model_type = self.config["model_type"]
        self.tool_format = tool_format_for(self.model_type, self.tokenizer.chat_template)
        self.think_markers = detected_think_markers(self.tokenizer, self.model_type)
        # The tower runs on rank 0 alone; the other ranks get its features (share_prompt).
        self.vision = None if self.is_follower else load_vision(model_dir)
        if self.vision is not None:
            self.vision.bind(inner_model(self.model), self.tokenizer)
        first_layer = shard.start_layer if isinstance(shard, PipelineShardMetadata) else 0
        self.image_attention = install_image_attention(model_dir, inner_model(self.model), first_layer)
        self.pipeline_ranks = shard.world_size if isinstance(shard, PipelineShardMetadata) else 1
        self.card_defaults = shard.model_card.sampling_defaults.model_dump(exclude_none=True)
        self.card_speculative = shard.model_card.speculative
        self.reasoning_dialect = shard.model_card.reasoning_dialect.value
        # Room for the warm-up; warm_up measures what a token of KV costs and sets the budget.
        device = mlx_device()
        step = limits.step_tokens(device)
        chunk = limits.chunk_tokens(device)
        forward = limits.forward_tokens(device, step, chunk)
        self.scheduler = Scheduler(
            self,
            Budget(
                kv_tokens=1 << 20,
                step_tokens=step,
                prefix_cache_tokens=1 << 20,
                chunk_tokens=min(chunk or step, forward),
                forward_tokens=forward,
            ),
        )

    def warm_up(self) -> int:
        if self.is_follower:
            # Step along with rank 0 until it says warm-up is over.
            generated = 0
            while True:
                ops = self._apply_ops()
                self._step_scheduler()
                if any(isinstance(op, EndWarmup) for op in ops):
                    break
                generated += 1
        else:
            generated = generate_warmup(self)
            if self.group is not None:
                self._pending_ops.append(EndWarmup())
                self.step()
        self._set_budget()
        return generated

    def _set_budget(self) -> None:
        """The budget from the device's memory and what a token of KV costs here,
        measured on a cache holding one token (every rank at once: a forward of a split
        is a collective); on a split, the fewest tokens any rank fits."""
        scheduler = self._scheduler()
        assert self.model is not None and self.tokenizer is not None
        scheduler.prefix_cache.clear()  # the warm-up's prompt, which no one sends
        cache = make_prompt_cache(self.model)
        prefill_chunk(self.model, [self.tokenizer.bos_token_id or 0], cache, self.pipeline_ranks)
        per_token = kv_bytes_per_token(cache)
        weights = mx.get_active_memory()
        budget = scheduler.budget
        activations = activation_bytes(self.config, budget.forward_tokens or budget.step_tokens, limits.MAX_BATCH)
        spare = max(0, device_memory() - weights - activations)
        scores = spare // 4
        # A fifth of the rest stays free for what MLX holds twice for a moment (a cache
        # grown by concatenation, the decode batch as requests join and leave).
        kv_tokens = (spare - scores) * 4 // 5 // per_token
        area = forward_area(self.config, scores, budget.chunk_tokens or budget.step_tokens)
        if self.group is not None:
            kv_tokens = agree_on_minimum(kv_tokens, self.group, self.collective_stream)
            area = agree_on_minimum(area, self.group, self.collective_stream)
        # The step's tokens and each prompt's chunk stay as load set them.
        scheduler.budget = replace(
            scheduler.budget,
            kv_tokens=kv_tokens,
            prefix_cache_tokens=limits.PREFIX_CACHE_BYTES // per_token,
            forward_area=area,
            budget_bytes=spare,
            weights_bytes=weights,
            kv_bytes_per_token=per_token,
        )
        # MLX's buffer cache keeps one forward's temporaries for the next to reuse.
        cached = activations + area * score_bytes_per_pair(self.config)
        limit_buffer_cache(cached)
        logger.info(
            f"memory budget: {spare >> 20} MiB beside {weights >> 20} MiB of weights and {activations >> 20} MiB "
            f"of activations; {kv_tokens} tokens of KV at {per_token} bytes each; MLX's buffer cache at most "
            f"{cached >> 20} MiB"
        )

    def _scheduler(self) -> Scheduler:
        assert self.scheduler is not None, "load() first"
        return self.scheduler

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
        return agree_on_ops(ops, self.group, self.collective_stream)

    def _apply_ops(self) -> list[RankOp]:
        ops = self._agree_on_ops()
        for op in ops:
            match op:
                case StartRequest():
                    self._start_in_step(op)
                case CancelRequest(request_id=request_id):
                    self._scheduler().cancel(request_id)
                    self._batch.settle()
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
            self._held_images.pop(op.request_id, None)
            message = f"could not start generation: {error}"
            # A ValueError is the input's (a processor refusing an image, a prompt that
            # cannot fit); others are ours.
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
        prompt, prompt_text, vision = self.prompt_of(op.request_id, params)
        mx.random.seed(op.seed)
        max_tokens = max_tokens_of(params)
        answer = AnswerStream(
            op.request_id,
            self._detokenizer(),
            output_parser_for(params, prompt_text, self.think_markers, self.tool_format),
            params.stop,
            self.tokenizer.eos_token_ids,
            max_tokens,
        )
        processors = self._logits_processors(params, max_tokens, op.grammar)
        greedy = sampling_settings(params, self.card_defaults, len(self.tokenizer._tokenizer)).temperature == 0
        proposer = self._proposer(params)
        work = _Work(self._sampler(params), processors, vision, speculative=proposer is not None, greedy=greedy)
        key = vision.key if vision is not None else []
        request = Request(op.request_id, prompt, answer, logprobs_wanted(params), work, key, proposer=proposer)
        request.kv_handoff = self._handoff_stats.pop(op.request_id, None)
        self._scheduler().add(request)

    # --- disaggregated serving (engine/kv_handoff.py) -------------------------------------

    def handoff_of(self, params: TextGenerationTaskParams, min_tokens: int) -> Handoff | None:
        """The decode side: what to ask a prefill engine for before submitting `params`,
        or None when this engine should prefill it itself (images, a single rank's
        split, fewer than `min_tokens` tokens left to prefill after its prefix cache)."""
        if params.images or self.group is not None:
            return None
        prompt, _, _ = self.prompt_of(CommandId("handoff"), params)
        skip = self.cached_prefix(prompt[:-1])
        if len(prompt) - 1 - skip < max(1, min_tokens):
            return None
        return Handoff(prompt, skip)

    def cached_prefix(self, tokens: list[int]) -> int:
        found = self._scheduler().prefix_cache.find(tokens)
        return found[1] if found is not None else 0

    def kv_assembler(self, handoff: Handoff) -> KvAssembler:
        """Where the handoff's parts go as they arrive (the decode side, or the prefill
        side receiving the decode side's offer)."""
        assert self.model is not None
        held = None
        if handoff.skip > 0:
            found = self._scheduler().prefix_cache.find(handoff.prompt[: handoff.skip])
            if found is None or found[1] < handoff.skip:
                raise ValueError("the prefix cache no longer holds the prompt's first tokens")
            held = (found[0].snapshot, found[0].length)
        return KvAssembler(handoff, make_prompt_cache(self.model), held)

    def import_kv(self, request_id: CommandId, sink: PartSink, stats: KvHandoffStats | None = None) -> None:
        """The assembled KV, in the prefix cache where the request's admission finds it
        (submit it next): its prompt's last token is fed here."""
        assert isinstance(sink, KvAssembler)
        cache = sink.finish()
        self._scheduler().prefix_cache.remember(sink.handoff.prompt[:-1], _saved(cache, sink.length))
        if stats is not None:
            self._handoff_stats[request_id] = stats

    def submit_prefill(self, request_id: CommandId, handoff: Handoff, send: Callable[[LayerPart], None]) -> None:
        """The prefill side: feed the handoff's prompt but its last token, stepped with
        the other requests, each chunk's KV passed to `send`; finished (finish_reason
        "stop") when the whole prompt is in."""
        assert self.tokenizer is not None, "load() first"
        if self.group is not None:
            raise ValueError("a split instance does not prefill for another")
        # Never fed: nothing is sampled here. Its one token is what admission reserves.
        answer = AnswerStream(
            request_id, self._detokenizer(), make_output_parser(None, None, None, False, None), [], [], 1
        )
        work = _Work(None, [], export=KvExporter(handoff.skip, send))
        request = Request(request_id, handoff.prompt[:-1], answer, None, work, prefill_only=True)
        self._scheduler().add(request)

    def _proposer(self, params: TextGenerationTaskParams) -> Proposer | None:
        """Where the request's proposals come from, if it decodes speculatively. A draft
        model's run on rank 0 alone, which sends them to the other ranks."""
        settings = speculative_settings(params, self.card_speculative)
        if settings is None or settings.method == "prompt_lookup":
            return PromptLookup(settings) if settings is not None else None
        if self.group is not None and self.is_follower:
            return SharedProposals(None, self.group, self.collective_stream)
        check_draft(settings, self.draft.model_id if self.draft is not None else None)
        assert self.draft is not None
        proposals = DraftProposals(settings, self.draft)
        return proposals if self.group is None else SharedProposals(proposals, self.group, self.collective_stream)

    def load_draft(self, model_dir: Path, model_id: str) -> None:
        """The instance's draft model, on rank 0 (the other ranks receive its proposals)."""
        assert self.tokenizer is not None, "load() first"
        self.draft = load_draft(model_dir, model_id, self.tokenizer)

    def _detokenizer(self) -> Any:
        """The answer's text as the tokenizer decodes its tokens (the llama.cpp engine's
        detokenizer): mlx-lm's BPE one drops the first token's leading space, which
        decoding keeps (an answer starting with " fast" came out as "fast")."""
        assert self.tokenizer is not None
        backend = getattr(self.tokenizer._tokenizer, "backend_tokenizer", None)
        return StreamingDetokenizer(backend) if backend is not None else self.tokenizer.detokenizer

    def prompt_of(
        self, request_id: CommandId, params: TextGenerationTaskParams
    ) -> tuple[list[int], str, VisionPrompt | None]:
        """The prompt's token ids as prefill feeds them (each image's run of soft tokens in
        place), its text, and its images. A prompt with images is tokenized as the model
        dir's processor tokenizes it."""
        assert self.tokenizer is not None
        prompt, prompt_text = encode_prompt(
            self.tokenizer, params, self.model_type, self.reasoning_dialect, as_processor=bool(params.images)
        )
        if not prompt:
            prompt = [self.tokenizer.bos_token_id or 0]
        vision = self._vision_prompt(request_id, params, prompt)
        return (vision.tokens if vision is not None else prompt), prompt_text, vision

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
            vision = share_prompt(vision, self.group, self.collective_stream, failure)
        return vision

    def _logits_processors(self, params: TextGenerationTaskParams, max_tokens: int, grammar: str | None) -> list[Any]:
        assert self.tokenizer is not None
        settings = sampling_settings(params, self.card_defaults, len(self.tokenizer._tokenizer))
        # mlx-lm penalizes whatever it was fed, which starts with the last prompt token;
        # dropping that one makes the penalties count generated tokens only, as OpenAI's do.
        penalties = [
            _without_prompt_token(processor)
            for processor in make_logits_processors(
                repetition_penalty=settings.repetition_penalty,
                repetition_context_size=max_tokens,
                presence_penalty=settings.presence_penalty,
                presence_context_size=max_tokens,
                frequency_penalty=settings.frequency_penalty,
                frequency_context_size=max_tokens,
            )
        ]
        processors = make_logits_processors(logit_bias=settings.bias) + penalties
        if grammar is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer._tokenizer, self.tokenizer.eos_token_ids)
            processors.append(GrammarProcessor(self._grammar_tokenizer, grammar))
        return processors

    def _sampler(self, params: TextGenerationTaskParams) -> Any:
        assert self.tokenizer is not None
        settings = sampling_settings(params, self.card_defaults, len(self.tokenizer._tokenizer))
        # Penalties and bias are logits processors; the sampler sees only these.
        key = (settings.temperature, settings.top_p, settings.min_p, settings.top_k)
        if key not in self._samplers:
            sampler = make_sampler(temp=key[0], top_p=key[1], min_p=key[2], top_k=key[3])
            self._samplers[key] = self._drawn_by_last_rank(sampler)
        return self._samplers[key]

    def _drawn_by_last_rank(self, draw: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        """On a pipeline only the last rank computes logits (the others see zeros): what it
        draws is every rank's draw, inside the forward's graph, so rank 0 embeds it next."""
        group = self.group
        if self.pipeline_ranks == 1 or group is None:
            return draw
        return lambda scores: from_last_rank(draw(scores), group)

    def step(self) -> list[ChunkGenerated]:
        if self.group is not None:
            self._apply_ops()
        failed, self._failed = self._failed, []
        chunks = self._step_scheduler()
        return [] if self.is_follower else failed + chunks

    def _step_scheduler(self) -> list[ChunkGenerated]:
        chunks = self._scheduler().step()
        self._batch.settle()  # the rows of the requests that finished in it
        return chunks

    # --- the scheduler's backend ---------------------------------------------------------

    def reserve(self, tokens: int) -> None:
        pass  # MLX allocates a request's KV as it grows

    def open(self, request: Request, cached: tuple[SavedKV, int] | None) -> int:
        assert self.model is not None
        work: _Work = request.work
        held = 0
        if cached is None:
            cache = make_prompt_cache(self.model)
        else:
            saved, held = cached
            cache = copy.deepcopy(saved.snapshot)
            if held < saved.length:
                trim_prompt_cache(cache, saved.length - held)
        if self.image_attention:
            attach_prompt_images(cache, work.vision)
        work.cache = cache
        return held

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        vision: VisionPrompt | None = request.work.vision
        return end if vision is None else vision.chunk_end(start, end)

    def run(self, rows: list[Row]) -> list[Sampled]:
        """Prompt chunks first (the batchable ones in one forward), then the requests
        whose prompt is done join the decode batch (together, one forward), then one
        batched decode forward; requests on their own take their own forwards."""
        assert self.model is not None
        sampled: list[Sampled] = []
        together: list[tuple[Row, list[int]]] = []
        joiners: list[Joiner] = []
        for row in rows:
            work: _Work = row.request.work
            if row.request.fed >= len(row.request.prompt):
                if not work.in_batch:
                    sampled.extend(self._decode_alone(row))
                continue
            # The prompt's last token is fed by the first decode step, which samples.
            chunk = row.tokens[:-1] if row.sample else row.tokens
            if work.batchable and self.group is None:
                if chunk:
                    together.append((row, chunk))
            elif chunk:
                self._prefill_alone(row, chunk)
            if row.sample and not work.batchable:
                sampled.extend(self._decode_alone(row))
        budget = self._scheduler().budget
        chunks = [(len(chunk), row.start + len(chunk)) for row, chunk in together]
        for group in forward_groups(chunks, budget.forward_area, budget.forward_tokens):
            forward = [together[index] for index in group]
            if len(forward) == 1:
                row, chunk = forward[0]
                prefill_chunk(self.model, chunk, row.request.work.cache, self.pipeline_ranks)
                continue
            caches = prefill_together(
                self.model, [row.request.work.cache for row, _ in forward], [chunk for _, chunk in forward]
            )
            for (row, _), cache in zip(forward, caches, strict=True):
                row.request.work.cache = cache
        _export_chunks(rows)
        for row in rows:
            work = row.request.work
            if row.sample and work.batchable and not work.in_batch:
                joiners.append(
                    Joiner(row.request.request_id, work.cache, row.tokens[-1], work.sampler, work.logits_processors)
                )
                work.in_batch, work.cache = True, []
        self._batch.join(self.model, joiners)
        by_id = {row.request.request_id: row.request for row in rows}
        for request_id, token, logprobs in self._batch.step():
            request = by_id[request_id]
            sampled.append(Sampled(request, token, self._logprob(request, token, logprobs)))
        return sampled

    def _prefill_alone(self, row: Row, chunk: list[int]) -> None:
        assert self.model is not None
        work: _Work = row.request.work
        whole_runs = work.vision is not None and work.vision.whole_runs
        prefill_chunk(
            self.model,
            chunk,
            work.cache,
            self.pipeline_ranks,
            self._chunk_inputs(work, row.start),
            micro_chunks=not whole_runs,
        )

    def _decode_alone(self, row: Row) -> list[Sampled]:
        assert self.model is not None
        work: _Work = row.request.work
        if work.speculative:
            return self._verify(row)
        if work.tokens is None:
            work.tokens = generate_step(
                mx.array(row.tokens[-1:]),
                self.model,
                max_tokens=row.request.answer.max_tokens,
                sampler=work.sampler,
                logits_processors=work.logits_processors or None,
                prompt_cache=work.cache,
            )
        token_array, logprobs = next(work.tokens)
        token = cast(int, token_array.item()) if isinstance(token_array, mx.array) else int(token_array)
        return [Sampled(row.request, token, self._logprob(row.request, token, logprobs))]

    def _verify(self, row: Row) -> list[Sampled]:
        """The row's last token and its drafts in one forward; then, position by position,
        a draw as generate_step draws (logits processors over the tokens fed so far, the
        sampler over log-probabilities), kept while it equals the next draft. The KV is cut
        back to the tokens kept."""
        assert self.model is not None
        work: _Work = row.request.work
        fed = row.tokens[-(row.drafts + 1) :]
        with mx.stream(generation_stream):
            logits = self.model(mx.array(fed)[None], cache=work.cache)[0]
            drawn: list[Sampled] = []
            # Greedy with nothing to process: every position's draw at once, one sync.
            argmaxes = (
                cast(list[int], self._drawn_by_last_rank(lambda x: mx.argmax(x, axis=-1))(logits).tolist())
                if work.greedy and not work.logits_processors and row.request.want_logprobs is None
                else None
            )
            for position in range(len(fed)):
                if argmaxes is not None:
                    drawn.append(Sampled(row.request, argmaxes[position]))
                    if position == row.drafts or argmaxes[position] != fed[position + 1]:
                        break
                    continue
                scores = logits[position : position + 1]
                if work.logits_processors:
                    history = mx.array(work.history + fed[: position + 1])
                    for processor in work.logits_processors:
                        scores = processor(history, scores)
                logprobs = scores - mx.logsumexp(scores, keepdims=True)
                token = cast(int, work.sampler(logprobs).item())
                drawn.append(Sampled(row.request, token, self._logprob(row.request, token, logprobs[0])))
                if position == row.drafts or token != fed[position + 1]:
                    break
            if len(drawn) < len(fed):
                trim_prompt_cache(work.cache, len(fed) - len(drawn))
        work.history += fed[: len(drawn)]
        return drawn

    def can_speculate(self, request: Request) -> bool:
        cache: list[Any] = request.work.cache
        return bool(cache) and can_trim_prompt_cache(cache)

    def snapshot(self, request: Request) -> SavedKV | None:
        cache: list[Any] = request.work.cache
        if not cache or can_trim_prompt_cache(cache):
            return None  # a trimmable cache is cut back to a boundary when one is wanted
        return _saved(copy.deepcopy(cache), request.fed)

    def release(self, request: Request) -> SavedKV | None:
        """The request's cache for the prefix cache: it holds the prompt and the tokens
        generated so far (mlx-lm feeds a token before handing it out), as its offset
        says; one holding a token computed ahead is trimmed back."""
        work: _Work = request.work
        cache = self._batch.leave(request.request_id) if work.in_batch else work.cache
        work.cache, work.tokens, work.in_batch = [], None, False
        if not cache:
            return None
        known = len(request.prompt) + len(request.output)
        held = max((c.offset for c in cache if hasattr(c, "offset")), default=known)
        if held > known:
            if not can_trim_prompt_cache(cache):
                return None  # where such a cache stopped is not known: not resumable
            trim_prompt_cache(cache, held - known)
            held = known
        return _saved(cache, held)

    def peak_memory(self) -> int:
        return mx.get_peak_memory()

    def _chunk_inputs(self, work: _Work, offset: int) -> ChunkInputs | None:
        """For a prompt with images: the inputs of the chunk starting at `offset`."""
        prompt = work.vision
        if prompt is None:
            return None
        assert self.model is not None
        inner = inner_model(self.model)
        return lambda start, end: prompt.chunk_inputs(inner, offset + start, offset + end)

    def _logprob(self, request: Request, token: int, logprobs: mx.array) -> TokenLogprob | None:
        """A token's log probability and its top alternatives. Extreme sampling settings
        (a repetition penalty near 0, say) can leave -inf or NaN, which JSON cannot carry;
        those become -9999.0, OpenAI's own floor for a token that cannot be picked."""
        top = request.want_logprobs
        if top is None:
            return None
        assert self.tokenizer is not None
        if self.pipeline_ranks > 1 and self.group is not None:
            with mx.stream(generation_stream):  # the forward's collectives' stream
                logprobs = from_last_rank(logprobs, self.group)
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

    @property
    def request_counts(self) -> tuple[int, int]:
        return self.scheduler.counts if self.scheduler is not None else (0, 0)

    @property
    def has_work(self) -> bool:
        return bool(self._pending_ops) or (self.scheduler is not None and self.scheduler.has_work)

    @property
    def memory(self) -> RunnerMemory | None:
        return self.scheduler.memory() if self.scheduler is not None else None

    def close(self) -> None:
        if self.group is not None and not self.is_follower:
            self._pending_ops.append(StopFollowers())
            self._apply_ops()
        self._batch = DecodeBatch()
        self.model = None
        self.tokenizer = None
        self.scheduler = None
        self.vision = None


def _export_chunks(rows: list[Row]) -> None:
    """What the prompt chunks of prefill-only requests added, to the engines decoding them."""
    for row in rows:
        work: _Work = row.request.work
        if work.export is not None:
            end = row.start + len(row.tokens)
            work.export.chunk_done(work.cache, end, end == len(row.request.prompt))


def _saved(cache: list[Any], length: int) -> SavedKV:
    return SavedKV(cache, length, sum(c.nbytes for c in cache), can_trim_prompt_cache(cache))


def _json_logprob(value: mx.array) -> float:
    logprob = cast(float, value.item())
    return logprob if math.isfinite(logprob) else -9999.0
