"""Generation with llama.cpp (ggml's CPU kernels), behind the same Engine protocol as
MLX. exo builds the prompt (chat template, reasoning dialect: engine/encoding/),
tokenizes with the model's Hugging Face tokenizer and feeds llama.cpp token ids; it
samples from llama.cpp's logits itself (sampling.py) and parses the output as for MLX
(engine/answer.py).

Each step is one llama_decode over one batch holding every running request: the next
token of each decoding request, and up to PREFILL_STEP prompt tokens of the requests
still prefilling (oldest first), each on its own sequence of one context. Requests join
and leave between steps, up to MAX_BATCH at once; later ones wait in arrival order. A
request's KV is saved when it ends (slots.py), so a later prompt sharing its start
prefills only the rest.

The context starts small and grows (a new context, the running requests' KV moved over)
to what the running requests may fill, up to the card's context: a KV far larger than
its use costs memory and, with values stored transposed, decode speed.

A pipeline instance is split with ggml's RPC backend (rpc.py): followers serve their
CPU, rank 0 runs everything else."""

import json
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger
from transformers import AutoTokenizer

from exo.engine.answer import AnswerStream, output_parser_for
from exo.engine.base import ConvertProgress, LayerProgress
from exo.engine.constrained import GrammarMask, grammar_for, grammar_tokenizer
from exo.engine.detokenizer import StreamingDetokenizer
from exo.engine.encoding.chat_prompt import encode_prompt
from exo.engine.limits import DEFAULT_MAX_TOKENS, MAX_BATCH, PREFILL_STEP
from exo.engine.llamacpp import rpc
from exo.engine.llamacpp.gguf_convert import gguf_for
from exo.engine.llamacpp.native import Context, Model
from exo.engine.llamacpp.sampling import Sampler, token_logprob
from exo.engine.llamacpp.slots import Slots
from exo.engine.parsing.output import think_markers_for, tool_format_for, vocabulary_think_markers
from exo.shared.models.families import family_facts
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import (
    ChatMessage,
    ChunkGenerated,
    GenerationStats,
    PrefillProgress,
    TextGenerationTaskParams,
    Usage,
)

# KV cells of the context (all sequences together): the card's context, at most this.
MAX_CONTEXT = int(os.environ.get("EXO_LLAMACPP_CONTEXT", "32768"))
# KV cells a context starts with, and the step its size is rounded to when it grows.
FIRST_CONTEXT = 512
CONTEXT_STEP = 256
# A finished request's KV on a split is saved only if that takes at most this many RPC
# round trips (each ~0.1 ms on loopback, more on a LAN): a request that decoded among
# others has its KV in as many pieces as it had steps, and a float32 KV's values are
# read a row at a time. 8 such requests on a 2-node split took 3.4 s each to save.
MAX_SAVE_ROUND_TRIPS = 256


@dataclass
class _Request:
    request_id: CommandId
    params: TextGenerationTaskParams
    prompt: list[int]
    sampler: Sampler
    answer: AnswerStream
    want_logprobs: int | None  # None: none; else how many alternatives
    submitted_at: float
    sequence: int | None = None  # its sequence once admitted
    fed: int = 0  # tokens in its sequence's KV
    cached_tokens: int = 0
    shared_steps: int = 0  # steps its tokens shared with another sequence's (its KV is in pieces)
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


class LlamaCppEngine:
    def __init__(self) -> None:
        self.model: Model | None = None
        self.context: Context | None = None
        self.slots: Slots | None = None
        # A transformers fast tokenizer (its stubs type too little to say so).
        self.tokenizer: Any = None
        self.eos_token_ids: set[int] = set()
        self.model_type = ""
        self.reasoning_dialect = "none"
        self.tool_format: str | None = None
        self.think_markers: tuple[str, str] | None = None
        self.card_defaults: dict[str, float | int] = {}
        self.rank = 0
        self.endpoints: list[str] = []  # the followers' RPC servers (rank 0)
        self.follower_layers: list[int] = []  # their layer counts, in rank order
        self.f32_kv = False
        self.kv_width = 0  # keys (and values) per token per layer
        self.max_context = 0  # KV cells the context may grow to
        self._requests: dict[CommandId, _Request] = {}
        self._grammar_tokenizer = None
        self.shutdown_requested = False

    @property
    def is_follower(self) -> bool:
        # A follower only serves its CPU to rank 0's llama.cpp, from a thread: its runner
        # keeps reading its own instructions, so it shuts down when its worker says so.
        return False

    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        self.rank = shard.device_rank
        if shard.world_size == 1:
            return
        if self.rank > 0:
            rpc.serve(_listen_endpoint(instance.hosts[self.rank]))
        else:
            self.endpoints = instance.hosts[1:]
            shards = sorted(instance.shard_assignments.runner_to_shard.values(), key=lambda s: s.device_rank)
            self.follower_layers = [s.end_layer - s.start_layer for s in shards[1:]]

    def load(
        self,
        model_dir: Path,
        shard: ShardMetadata,
        on_layer_loaded: LayerProgress,
        on_converted: ConvertProgress | None = None,
    ) -> None:
        total = shard.end_layer - shard.start_layer
        if self.rank > 0:
            on_layer_loaded(total, total)  # rank 0 sends this rank's layers over RPC
            return
        config = json.loads((model_dir / "config.json").read_text())
        self.model_type = config["model_type"]
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, config)
        self.tool_format = tool_format_for(self.model_type, self.tokenizer.chat_template)
        detected = vocabulary_think_markers(self.tokenizer.get_vocab())
        self.think_markers = think_markers_for(self.model_type, detected)
        self.card_defaults = shard.model_card.sampling_defaults.model_dump(exclude_none=True)
        self.reasoning_dialect = shard.model_card.reasoning_dialect.value
        gguf = gguf_for(model_dir, _gguf_cache_dir(), on_converted)
        n_layers = shard.n_layers
        devices = rpc.remote_devices(self.endpoints) if self.endpoints else []
        self.model = Model(
            gguf,
            on_progress=lambda value: on_layer_loaded(min(total, round(value * total)), total),
            devices=devices,
            offload_layers=n_layers - shard.end_layer,
            split=[float(n) for n in self.follower_layers],
        )
        self.max_context = min(shard.model_card.context_length or 4096, MAX_CONTEXT)
        self.f32_kv = keeps_f32_cache(config)
        self.kv_width = _kv_width(config)
        # A split's KV is partly on the followers: moving it to a larger context would
        # read and write it over RPC, so a split starts at its full size.
        first = self.max_context if self.endpoints else min(FIRST_CONTEXT, self.max_context)
        self.context = self._new_context(first)
        self.slots = Slots(self.context, MAX_BATCH)
        logger.info(
            f"llama.cpp: {gguf.name}, {self.model.n_layers} layers, context {self.context.n_ctx} of {self.max_context}"
        )

    def _new_context(self, n_ctx: int) -> Context:
        assert self.model is not None
        return Context(self.model, n_ctx, MAX_BATCH, PREFILL_STEP + MAX_BATCH, f32_kv=self.f32_kv)

    def warm_up(self) -> int:
        if self.rank > 0:
            return 0
        params = TextGenerationTaskParams(
            model=ModelId("warmup"),
            messages=[ChatMessage(role="user", content="Hello")],
            max_tokens=4,
            temperature=0.0,
        )
        self.submit(CommandId("warmup"), params)
        generated = 0
        while self._requests:
            generated += sum(len(chunk.token_ids) for chunk in self.step())
        assert self.slots is not None
        # The warm-up's snapshot holds a prompt no one sends.
        self.slots.clear()
        return generated

    def submit(self, request_id: CommandId, params: TextGenerationTaskParams) -> None:
        assert self.tokenizer is not None and self.model is not None, "load() first"
        grammar = grammar_for(params.response_format)
        if params.images:
            raise ValueError(f"{params.model} takes no images on the llama.cpp engine")
        if grammar is not None and params.enable_thinking is None:
            # The grammar holds from the first token; a thinking block would swallow it.
            params = params.model_copy(update={"enable_thinking": False})
        prompt, prompt_text = encode_prompt(
            self.tokenizer, params, self.model_type, self.reasoning_dialect, self.think_markers
        )
        if not prompt:
            prompt = [self.tokenizer.bos_token_id or 0]
        if max(prompt) >= self.model.n_vocab or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be below the vocabulary size {self.model.n_vocab}")
        room = self.context_room(prompt)
        if room < 1:
            raise ValueError(f"the prompt's {len(prompt)} tokens leave no room in the context of {len(prompt) + room}")
        # An answer ends ("length") where its context does, not in an error.
        max_tokens = min(params.max_tokens or DEFAULT_MAX_TOKENS, room)
        answer = AnswerStream(
            request_id,
            StreamingDetokenizer(self.tokenizer.backend_tokenizer),
            output_parser_for(params, prompt_text, self.think_markers, self.tool_format),
            params.stop,
            self.eos_token_ids,
            max_tokens,
        )
        self._requests[request_id] = _Request(
            request_id=request_id,
            params=params,
            prompt=prompt,
            sampler=self._sampler(params, grammar),
            answer=answer,
            want_logprobs=(params.top_logprobs or 0) if params.logprobs else None,
            submitted_at=time.perf_counter(),
        )

    def context_room(self, prompt: list[int]) -> int:
        """Tokens an answer to `prompt` can have before the context is full."""
        return self.max_context - len(prompt)

    def _sampler(self, params: TextGenerationTaskParams, grammar: str | None) -> Sampler:
        assert self.tokenizer is not None and self.model is not None
        mask = None
        if grammar is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.eos_token_ids)
            mask = GrammarMask(self._grammar_tokenizer, grammar)
        vocab = self.model.n_vocab
        top_k = int(self._pick(params, "top_k", 0))
        return Sampler(
            temperature=float(self._pick(params, "temperature", 0.7)),
            top_p=float(self._pick(params, "top_p", 1.0)),
            # Keeping the whole vocabulary or more is no filter at all.
            top_k=0 if top_k >= vocab else top_k,
            min_p=float(self._pick(params, "min_p", 0.0)),
            repetition_penalty=self._pick(params, "repetition_penalty", None),
            presence_penalty=self._pick(params, "presence_penalty", None),
            frequency_penalty=self._pick(params, "frequency_penalty", None),
            # Out-of-range ids are dropped rather than refused: only the engine knows the
            # vocabulary.
            bias={token: value for token, value in (params.logit_bias or {}).items() if 0 <= token < vocab},
            grammar=mask,
            seed=params.seed if params.seed is not None else random.getrandbits(31),
        )

    def _pick(self, params: TextGenerationTaskParams, name: str, fallback: Any) -> Any:
        """The request's value, else the model card's recommendation, else `fallback`."""
        value = getattr(params, name)
        return value if value is not None else self.card_defaults.get(name, fallback)

    def cancel(self, request_id: CommandId) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and request.sequence is not None:
            self._leave(request)

    def step(self) -> list[ChunkGenerated]:
        assert self.context is not None and self.slots is not None
        running = list(self._requests.values())[:MAX_BATCH]
        # Before new requests take sequences: a prefix cache snapshot needs room to land.
        wanted = sum(len(request.prompt) + request.answer.max_tokens for request in running)
        self._grow_context(context_size(self.context.n_ctx, wanted, self.max_context), running)
        for request in running:
            if request.sequence is None:
                request.sequence, request.cached_tokens = self.slots.take(request.prompt)
                request.fed = request.cached_tokens
        plan = self._fill_batch(running)
        while self.context.decode() == 1:
            # No room in the KV cache for the running requests (llama.cpp left it as it
            # was, and the batch refills the same): a larger context, else the newest
            # request gives way.
            if self.context.n_ctx >= self.max_context:
                return [self._fail(running[-1], f"the context of {self.context.n_ctx} tokens is full")]
            self._grow_context(context_size(self.context.n_ctx, self.context.n_ctx + 1, self.max_context), running)
            plan = self._fill_batch(running)
        if len(plan) > 1:
            for request, _, _ in plan:
                request.shared_steps += 1
        chunks: list[ChunkGenerated] = []
        for request, fed, index in plan:
            prefilled = request.prefilling
            request.fed = fed
            if prefilled:
                chunks.append(
                    ChunkGenerated(
                        command_id=request.request_id,
                        prefill=PrefillProgress(processed_tokens=fed, total_tokens=len(request.prompt)),
                    )
                )
            if index is not None:
                chunks.append(self._next_token(request, index))
        return chunks

    def _grow_context(self, n_ctx: int, running: list[_Request]) -> None:
        """A context of `n_ctx` cells in place of the current one (when larger), holding
        the running requests' KV (saved to host memory and restored, sequence by sequence)."""
        assert self.context is not None and self.slots is not None
        if n_ctx <= self.context.n_ctx:
            return
        started = time.perf_counter()
        held = [(r.sequence, self.context.save(r.sequence)) for r in running if r.sequence is not None and r.fed]
        previous = self.context.n_ctx
        self.context.close()
        try:
            self.context = self._new_context(n_ctx)
        except RuntimeError:
            # No memory for it: the context stays as it was and becomes the ceiling;
            # answers end ("length") where it is full, new prompts are told their room.
            logger.warning(f"llama.cpp: no context of {n_ctx} cells here; staying at {previous}")
            self.max_context = previous
            self.context = self._new_context(previous)
            for request in self._requests.values():  # the queued ones too
                answer = request.answer
                answer.max_tokens = max(1, min(answer.max_tokens, previous - len(request.prompt)))
        self.slots.context = self.context
        for sequence, state in held:
            if not self.context.restore(state, sequence):
                cells = self.context.n_ctx
                raise RuntimeError(f"llama.cpp could not move sequence {sequence} to a context of {cells} cells")
        elapsed = time.perf_counter() - started
        moved = f"{len(held)} sequences moved in {elapsed:.2f} s"
        logger.info(f"llama.cpp: context now {self.context.n_ctx} cells ({moved})")

    def _fill_batch(self, running: list[_Request]) -> list[tuple[_Request, int, int | None]]:
        """Every decoding request's last token, then prompt chunks within the budget.
        Returns, per request in the batch, what its KV holds after the step and the
        batch row whose logits give its next token (None: still prefilling)."""
        assert self.context is not None
        batch = self.context.batch
        batch.clear()
        plan: list[tuple[_Request, int, int | None]] = []
        for request in running:
            if not request.prefilling:
                assert request.sequence is not None
                index = batch.add(request.output[-1:], request.fed, request.sequence, True)
                plan.append((request, request.fed + 1, index))
        budget = PREFILL_STEP
        for request in running:
            if budget <= 0 or not request.prefilling:
                continue
            assert request.sequence is not None
            end = min(request.fed + budget, len(request.prompt))
            done = end == len(request.prompt)
            index = batch.add(request.prompt[request.fed : end], request.fed, request.sequence, done)
            budget -= end - request.fed
            plan.append((request, end, index if done else None))
        return plan

    def _next_token(self, request: _Request, index: int) -> ChunkGenerated:
        assert self.context is not None and self.tokenizer is not None
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        token, logprobs = request.sampler.choose(self.context.logits(index), request.want_logprobs is not None)
        request.sampler.accept(token)
        request.output.append(token)
        logprob = None
        if request.want_logprobs is not None and logprobs is not None:
            logprob = token_logprob(self.tokenizer.decode, token, logprobs, request.want_logprobs)
        chunk = request.answer.feed(token, logprob)
        if chunk.finish_reason is None:
            return chunk
        del self._requests[request.request_id]
        self._leave(request)
        return chunk.model_copy(update={"usage": self._usage(request), "stats": self._stats(request)})

    def _leave(self, request: _Request) -> None:
        """The request's KV is saved for the prefix cache with what it holds: the prompt
        and every generated token but the last (never fed); unless reading it back from
        the followers would stall the batch."""
        assert self.slots is not None and request.sequence is not None
        if self._save_round_trips(request) > MAX_SAVE_ROUND_TRIPS:
            self.slots.release(request.sequence)
        else:
            self.slots.keep(request.sequence, (request.prompt + request.output)[: request.fed])
        request.sequence = None

    def _save_round_trips(self, request: _Request) -> int:
        """The RPC calls that saving the request's KV costs: llama.cpp reads a sequence
        one run of cells at a time, per layer, keys then values; its values transposed
        (a float32 KV, without flash attention) one row of a run at a time. Each step the
        request shared with other sequences may have started a new run."""
        remote_layers = sum(self.follower_layers)
        if remote_layers == 0:
            return 0
        runs = 1 + request.shared_steps
        per_run = 1 + (self.kv_width if self.f32_kv else 1)
        return remote_layers * runs * per_run

    def _fail(self, request: _Request, message: str) -> ChunkGenerated:
        del self._requests[request.request_id]
        assert self.slots is not None and request.sequence is not None
        self.slots.release(request.sequence)
        return ChunkGenerated(command_id=request.request_id, finish_reason="error", error_message=message)

    def _usage(self, request: _Request) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt),
            completion_tokens=request.answer.generated,
            reasoning_tokens=request.answer.reasoning_tokens,
            cached_tokens=request.cached_tokens,
        )

    def _stats(self, request: _Request) -> GenerationStats:
        now = time.perf_counter()
        first = request.first_token_at or now
        generated = request.answer.generated
        return GenerationStats(
            prompt_tps=len(request.prompt) / max(first - request.submitted_at, 1e-9),
            generation_tps=(generated - 1) / max(now - first, 1e-9) if generated > 1 else 0.0,
            prompt_tokens=len(request.prompt),
            generation_tokens=generated,
            peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )

    @property
    def request_counts(self) -> tuple[int, int]:
        running = min(len(self._requests), MAX_BATCH)
        return running, len(self._requests) - running

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    def close(self) -> None:
        self._requests.clear()
        if self.context is not None:
            self.context.close()
        if self.model is not None:
            self.model.close()
        self.context = self.model = self.slots = None


def context_size(current: int, wanted: int, ceiling: int) -> int:
    """The context's cells for `wanted` (current when it holds them): at least double, so
    it grows a few times at most, in CONTEXT_STEP steps, never past `ceiling`."""
    if wanted <= current:
        return current
    rounded = -(-wanted // CONTEXT_STEP) * CONTEXT_STEP
    return min(ceiling, max(rounded, 2 * current))


def keeps_f32_cache(config: dict) -> bool:
    """A float32 checkpoint keeps float32 keys and values: its own precision."""
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype == "float32" and "quantization" not in config


def _kv_width(config: dict) -> int:
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return heads * head_dim


def _listen_endpoint(host: str) -> str:
    """A follower listens on every address at its rank's port (rank 0 reaches it at the
    address placement chose)."""
    return f"0.0.0.0:{host.rsplit(':', 1)[1]}"


def _eos_token_ids(tokenizer: Any, config: dict) -> set[int]:
    """The config's EOS ids, the tokenizer's, and the family's turn ends that the
    tokenizer treats as special (as the MLX engine counts them)."""
    configured = config.get("eos_token_id")
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    special = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    ids |= {i for i in family_facts(config["model_type"]).eos_ids if i in special}
    return ids


def _gguf_cache_dir() -> Path:
    home = Path(os.environ.get("EXO_HOME", Path.home() / ".exo")).expanduser()
    return home / "cache" / "gguf"
