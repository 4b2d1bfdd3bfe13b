"""Generation with llama.cpp (ggml's CPU kernels), behind the same Engine protocol as
MLX. exo builds the prompt (chat template, reasoning dialect: engine/encoding/),
tokenizes with the model's Hugging Face tokenizer and feeds llama.cpp token ids; it
samples from llama.cpp's logits itself (sampling.py) and parses the output as for MLX
(engine/answer.py).

It is a backend of the engine-neutral scheduler (engine/scheduler.py), which plans each
step: one llama_decode runs the whole plan, the next token of each decoding request and
the prompt chunks of several prefilling ones, each request on its own sequence of one
context. The scheduler admits requests by the context's cells (each running request
holds its prompt and whole answer), so a prompt that arrives when the cells are taken
waits. A finished request's KV is saved to host memory for the prefix cache and its
cells freed: in one unified KV every decode attends over the cells up to the highest one
in use, so kept sequences slowed every running request (a 1024x16 llama's decode went
from 8.6 to 12 ms a token as five finished 900-token requests stayed).

The context starts small and grows (a new context, the running requests' KV moved over)
to what the admitted requests may fill, up to the card's context: a KV far larger than
its use costs memory and, with values stored transposed, decode speed.

A pipeline instance is split with ggml's RPC backend (rpc.py): followers serve their
CPU, rank 0 runs everything else."""

import json
import os
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger
from transformers import AutoTokenizer

from exo.engine import limits
from exo.engine.answer import AnswerStream, output_parser_for
from exo.engine.base import ConvertProgress, LayerProgress, generate_warmup
from exo.engine.constrained import GrammarMask, grammar_for, grammar_tokenizer
from exo.engine.detokenizer import StreamingDetokenizer
from exo.engine.encoding.chat_prompt import encode_prompt
from exo.engine.llamacpp import rpc
from exo.engine.llamacpp.draft import DraftModel, DraftProposals, load_draft
from exo.engine.llamacpp.gguf_convert import gguf_for
from exo.engine.llamacpp.native import Context, Model, SequenceState
from exo.engine.llamacpp.sampling import Sampler, token_logprob
from exo.engine.llamacpp.support import gguf_cache_dir
from exo.engine.parsing.output import think_markers_for, tool_format_for, vocabulary_think_markers
from exo.engine.prefix_cache import SavedKV
from exo.engine.request_settings import logprobs_wanted, max_tokens_of, sampling_settings
from exo.engine.scheduler import Budget, Request, Row, Sampled, Scheduler
from exo.engine.speculative import PromptLookup, Proposer, check_draft, speculative_settings
from exo.shared.models.families import family_facts
from exo.shared.types.common import CommandId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerMemory
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChunkGenerated, Speculative, TextGenerationTaskParams

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
class _Work:
    """A request's part on llama.cpp: its sampler, and its sequence once admitted."""

    sampler: Sampler
    sequence: int | None = None
    shared_steps: int = 0  # steps its tokens shared with another sequence's (its KV is in pieces)


class LlamaCppEngine:
    def __init__(self) -> None:
        self.model: Model | None = None
        self.context: Context | None = None
        self.draft: DraftModel | None = None
        self.scheduler: Scheduler | None = None
        # A transformers fast tokenizer (its stubs type too little to say so).
        self.tokenizer: Any = None
        self.eos_token_ids: set[int] = set()
        self.model_type = ""
        self.reasoning_dialect = "none"
        self.tool_format: str | None = None
        self.think_markers: tuple[str, str] | None = None
        self.card_defaults: dict[str, float | int] = {}
        self.card_speculative: Speculative | None = None
        self.rank = 0
        self.endpoints: list[str] = []  # the followers' RPC servers (rank 0)
        self.follower_layers: list[int] = []  # their layer counts, in rank order
        self.f32_kv = False
        self.kv_width = 0  # keys (and values) per token per layer
        self.max_context = 0  # KV cells the context may grow to
        self.step_tokens = limits.step_tokens("cpu")
        self._open: dict[CommandId, Request] = {}  # admitted requests, with a sequence
        self._free_sequences: list[int] = []
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
        self.card_speculative = shard.model_card.speculative
        self.reasoning_dialect = shard.model_card.reasoning_dialect.value
        gguf = gguf_for(model_dir, gguf_cache_dir(), on_converted)
        n_layers = shard.n_layers
        devices = rpc.remote_devices(self.endpoints) if self.endpoints else []
        self.model = Model(
            gguf,
            on_progress=lambda value: on_layer_loaded(min(total, round(value * total)), total),
            devices=devices,
            offload_layers=n_layers - shard.end_layer,
            split=[float(n) for n in self.follower_layers],
        )
        self.f32_kv = keeps_f32_cache(config)
        self.kv_width = _kv_width(config)
        kv_bytes_per_token = 2 * self.model.n_layers * self.kv_width * (4 if self.f32_kv else 2)
        weights = gguf.stat().st_size
        # The context's cells bound the running requests: the card's context, at most
        # what the node's memory holds beside the weights (the prefix cache's snapshots
        # share it).
        budget = limits.ram_budget(weights) - weights
        fit = budget // kv_bytes_per_token
        if fit < FIRST_CONTEXT:
            raise RuntimeError(
                f"{weights >> 20} MB of weights leave {max(0, budget) >> 20} MB of this node's memory budget: "
                f"too little for a context of {FIRST_CONTEXT} tokens"
            )
        self.max_context = min(shard.model_card.context_length or 4096, MAX_CONTEXT, fit)
        # A split's KV is partly on the followers: moving it to a larger context would
        # read and write it over RPC, so a split starts at its full size.
        first = self.max_context if self.endpoints else min(FIRST_CONTEXT, self.max_context)
        self.context = self._new_context(first)
        self._free_sequences = list(range(limits.MAX_BATCH - 1, -1, -1))
        self.scheduler = Scheduler(
            self,
            Budget(
                kv_tokens=fit,
                context_tokens=self.max_context,
                step_tokens=self.step_tokens,
                chunk_tokens=limits.chunk_tokens("cpu"),
                prefix_cache_tokens=min(limits.PREFIX_CACHE_BYTES, budget) // kv_bytes_per_token,
                weights_bytes=weights,
                kv_bytes_per_token=kv_bytes_per_token,
                budget_bytes=budget,
            ),
        )
        logger.info(
            f"llama.cpp: {gguf.name}, {self.model.n_layers} layers, context {self.context.n_ctx} of {self.max_context}"
        )

    def _new_context(self, n_ctx: int) -> Context:
        assert self.model is not None
        return Context(self.model, n_ctx, limits.MAX_BATCH, self.step_tokens, f32_kv=self.f32_kv)

    def warm_up(self) -> int:
        if self.rank > 0:
            return 0
        generated = generate_warmup(self)
        assert self.scheduler is not None
        # The warm-up's snapshot holds a prompt no one sends.
        self.scheduler.prefix_cache.clear()
        return generated

    def submit(self, request_id: CommandId, params: TextGenerationTaskParams) -> None:
        assert self.tokenizer is not None and self.model is not None and self.scheduler is not None, "load() first"
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
        answer = AnswerStream(
            request_id,
            StreamingDetokenizer(self.tokenizer.backend_tokenizer),
            output_parser_for(params, prompt_text, self.think_markers, self.tool_format),
            params.stop,
            self.eos_token_ids,
            max_tokens_of(params),
        )
        work = _Work(self._sampler(params, grammar))
        proposer = self._proposer(params)
        self.scheduler.add(Request(request_id, prompt, answer, logprobs_wanted(params), work, proposer=proposer))

    def _proposer(self, params: TextGenerationTaskParams) -> Proposer | None:
        """Where the request's proposals come from, if it decodes speculatively."""
        settings = speculative_settings(params, self.card_speculative)
        if settings is None or settings.method == "prompt_lookup":
            return PromptLookup(settings) if settings is not None else None
        check_draft(settings, self.draft.model_id if self.draft is not None else None)
        assert self.draft is not None
        return DraftProposals(settings, self.draft)

    def _sampler(self, params: TextGenerationTaskParams, grammar: str | None) -> Sampler:
        assert self.tokenizer is not None and self.model is not None
        mask = None
        if grammar is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.eos_token_ids)
            mask = GrammarMask(self._grammar_tokenizer, grammar)
        settings = sampling_settings(params, self.card_defaults, self.model.n_vocab)
        return Sampler(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            min_p=settings.min_p,
            repetition_penalty=settings.repetition_penalty,
            presence_penalty=settings.presence_penalty,
            frequency_penalty=settings.frequency_penalty,
            bias=settings.bias,
            grammar=mask,
            seed=params.seed if params.seed is not None else random.getrandbits(31),
        )

    def cancel(self, request_id: CommandId) -> None:
        assert self.scheduler is not None
        self.scheduler.cancel(request_id)

    def step(self) -> list[ChunkGenerated]:
        assert self.scheduler is not None
        return self.scheduler.step()

    # --- the scheduler's backend ---------------------------------------------------------

    def reserve(self, tokens: int) -> None:
        """A larger context when the admitted requests may fill more than it holds."""
        assert self.context is not None
        self._grow_context(context_size(self.context.n_ctx, tokens, self.max_context))

    def open(self, request: Request, cached: tuple[SavedKV, int] | None) -> int:
        assert self.context is not None
        work: _Work = request.work
        work.sequence = self._free_sequences.pop()
        self._open[request.request_id] = request
        if cached is None:
            return 0
        saved, length = cached
        if not self.context.restore(saved.snapshot, work.sequence):
            return 0  # no room for it in the KV now: prefill from the start
        self.context.remove(work.sequence, length, -1)
        return length

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        return end

    def run(self, rows: list[Row]) -> list[Sampled]:
        assert self.context is not None and self.tokenizer is not None
        batch = self.context.batch
        while True:
            batch.clear()
            indices = [
                batch.add(row.tokens, row.start, row.request.work.sequence, row.drafts + 1 if row.sample else 0)
                for row in rows
            ]
            if self.context.decode() == 0:
                break
            # No room in the KV (llama.cpp left it as it was): admission keeps the
            # requests within the context's cells, so only a context smaller than it
            # should be gets here.
            if self.context.n_ctx >= self.max_context:
                raise RuntimeError(f"llama.cpp found no room for the batch in {self.context.n_ctx} cells")
            self._grow_context(context_size(self.context.n_ctx, self.context.n_ctx + 1, self.max_context))
        sampled: list[Sampled] = []
        for row, index in zip(rows, indices, strict=True):
            work: _Work = row.request.work
            work.shared_steps += len(rows) > 1
            if row.sample:
                sampled += self._draw(row, index)
        return sampled

    def _draw(self, row: Row, last_index: int) -> list[Sampled]:
        """The row's next token; with drafts, a draw at each of their positions in turn,
        kept while it equals the next draft, and the KV cut back to the tokens kept."""
        assert self.context is not None and self.tokenizer is not None
        work: _Work = row.request.work
        want = row.request.want_logprobs
        drawn: list[Sampled] = []
        for position in range(row.drafts + 1):
            index = last_index - row.drafts + position
            token, logprobs = work.sampler.choose(self.context.logits(index), want is not None)
            work.sampler.accept(token)
            logprob = None
            if want is not None and logprobs is not None:
                logprob = token_logprob(self.tokenizer.decode, token, logprobs, want)
            drawn.append(Sampled(row.request, token, logprob))
            if position == row.drafts or token != row.tokens[len(row.tokens) - row.drafts + position]:
                break
        if len(drawn) <= row.drafts:
            assert work.sequence is not None
            self.context.remove(work.sequence, row.start + len(row.tokens) - row.drafts - 1 + len(drawn), -1)
        return drawn

    def can_speculate(self, request: Request) -> bool:
        return self.model is not None and self.model.trimmable

    def snapshot(self, request: Request) -> SavedKV | None:
        return None  # a sequence's KV is cut back to any length (llama_memory_seq_rm)

    def release(self, request: Request) -> SavedKV | None:
        """The request's KV is saved with what it holds (the prompt and every generated
        token but the last, never fed), unless reading it back from the followers would
        stall the batch; its cells are freed."""
        assert self.context is not None
        self._open.pop(request.request_id, None)
        work: _Work = request.work
        if work.sequence is None:
            return None
        saved = None
        if request.fed and self._save_round_trips(work) <= MAX_SAVE_ROUND_TRIPS:
            state = self.context.save(work.sequence)
            saved = SavedKV(state, request.fed, state.nbytes, trimmable=True)
        self.context.remove(work.sequence)
        self._free_sequences.append(work.sequence)
        work.sequence = None
        return saved

    def peak_memory(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _grow_context(self, n_ctx: int) -> None:
        """A context of `n_ctx` cells in place of the current one (when larger), holding
        the running requests' KV (saved to host memory and restored, sequence by sequence)."""
        assert self.context is not None and self.scheduler is not None
        if n_ctx <= self.context.n_ctx:
            return
        started = time.perf_counter()
        held: list[tuple[int, SequenceState]] = []
        for request in self._open.values():
            sequence = request.work.sequence
            if sequence is not None and request.fed:
                held.append((sequence, self.context.save(sequence)))
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
            self.scheduler.shrink(previous)
        for sequence, state in held:
            if not self.context.restore(state, sequence):
                cells = self.context.n_ctx
                raise RuntimeError(f"llama.cpp could not move sequence {sequence} to a context of {cells} cells")
        elapsed = time.perf_counter() - started
        moved = f"{len(held)} sequences moved in {elapsed:.2f} s"
        logger.info(f"llama.cpp: context now {self.context.n_ctx} cells ({moved})")

    def _save_round_trips(self, work: _Work) -> int:
        """The RPC calls that saving the request's KV costs: llama.cpp reads a sequence
        one run of cells at a time, per layer, keys then values; its values transposed
        (a float32 KV, without flash attention) one row of a run at a time. Each step the
        request shared with other sequences may have started a new run."""
        remote_layers = sum(self.follower_layers)
        if remote_layers == 0:
            return 0
        runs = 1 + work.shared_steps
        per_run = 1 + (self.kv_width if self.f32_kv else 1)
        return remote_layers * runs * per_run

    @property
    def request_counts(self) -> tuple[int, int]:
        return self.scheduler.counts if self.scheduler is not None else (0, 0)

    @property
    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work

    @property
    def memory(self) -> RunnerMemory | None:
        return self.scheduler.memory() if self.scheduler is not None else None

    def load_draft(self, model_dir: Path, model_id: str) -> None:
        """The instance's draft model, on rank 0, in a context of its own as large as the
        target's largest (the running requests' sequences and their guesses fit)."""
        assert self.tokenizer is not None, "load() first"
        config = json.loads((model_dir / "config.json").read_text())
        self.draft = load_draft(
            model_dir,
            model_id,
            self.tokenizer,
            n_ctx=self.max_context + limits.MAX_BATCH * CONTEXT_STEP,
            sequences=limits.MAX_BATCH,
            batch_tokens=self.step_tokens,
            f32_kv=keeps_f32_cache(config),
        )

    def close(self) -> None:
        self._open.clear()
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.context is not None:
            self.context.close()
        if self.model is not None:
            self.model.close()
        self.context = self.model = self.scheduler = None


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
