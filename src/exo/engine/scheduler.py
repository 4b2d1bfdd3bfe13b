"""One scheduler for every engine: the policy is here, each engine is a narrow backend
(vLLM's scheduler / worker split).

The scheduler owns the requests: the queue in arrival order and admission (at most
MAX_BATCH running, and the KV each may fill inside the runner's budget of tokens), the
per-step token budget, the prefix cache (which saved KV a prompt starts from, and which
entries give way first when room is short), cancellation, and each answer's finish,
usage and stats. A step is one plan: the last token of every decoding request, then
prompt chunks of the prefilling ones, oldest first, while the step's tokens last. The
backend runs the plan as one batch and returns the tokens it sampled, so prompts that
arrive together prefill together and a long prompt holds running streams up by one
step's budget at most. A request decoding speculatively (engine/speculative.py) feeds its
last token and the tokens proposed after it in its row, within the same budget, and
keeps those its sampler draws.

Admission reserves a request's prompt and its whole answer (max_tokens, capped to what
fits at all): a request whose KV would not fit beside the running ones waits in the
queue, so none fails mid-stream for lack of room; the prefix cache gives its entries up
first. A prompt that can never fit is refused with the number of tokens that do.

On a split instance every rank runs the same scheduler over the same requests: every
decision here depends on token counts alone (never on time or on one rank's bytes), so
every rank plans the same batch and the collectives agree."""

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from exo.engine import limits
from exo.engine.answer import AnswerStream
from exo.engine.prefix_cache import PrefixCache, SavedKV
from exo.engine.speculative import Proposer
from exo.shared.types.common import CommandId
from exo.shared.types.runners import RunnerMemory
from exo.shared.types.text_generation import (
    ChunkGenerated,
    GenerationStats,
    KvHandoffStats,
    PrefillProgress,
    TokenLogprob,
    Usage,
)


@dataclass
class Request:
    request_id: CommandId
    prompt: list[int]
    answer: AnswerStream
    want_logprobs: int | None  # None: none; else how many alternatives
    # The backend's own state of this request (sampler, its KV or sequence, images...).
    work: Any = None
    # What the prefix cache knows the prompt by (an image's run by its hash); the prompt
    # when empty.
    key: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.perf_counter)
    fed: int = 0  # tokens of prompt + output in its KV
    cached_tokens: int = 0
    reserved: int = 0  # KV tokens held for it while it runs
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    # Proposals for speculative decoding; None: plain decoding.
    proposer: Proposer | None = None
    # Fed for another engine to decode (engine/kv_handoff.py): its whole prompt goes into
    # the KV, nothing is sampled, and it finishes when the prompt is in.
    prefill_only: bool = False
    # Prefilled by another engine: what moving its KV took.
    kv_handoff: KvHandoffStats | None = None

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.prompt
        if self.proposer is not None:
            self.proposer.extend(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclass(frozen=True)
class Row:
    """One request's part of a step: `tokens` go into its KV from position `start` (a
    prompt chunk, or the token it sampled last and `drafts` proposed tokens after it);
    if `sample`, the next token is drawn from the last position's logits, or with
    drafts, from each position's in turn while the draws equal the proposals."""

    request: Request
    tokens: list[int]
    start: int
    sample: bool
    drafts: int = 0


@dataclass(frozen=True)
class Sampled:
    request: Request
    token: int
    logprob: TokenLogprob | None = None


class Backend(Protocol):
    """What an engine does under the scheduler."""

    def open(self, request: Request, cached: tuple[SavedKV, int] | None) -> int:
        """Give an admitted request its KV: a copy of the saved KV cut to its first n
        tokens when `cached` is (saved, n). Returns the tokens it starts with."""
        ...

    def reserve(self, tokens: int) -> None:
        """The admitted requests may fill this many tokens of KV together (called
        before `open` when it grows)."""
        ...

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a prompt chunk from `start` may end, given `end` (an image's run is fed
        whole)."""
        ...

    def run(self, rows: list[Row]) -> list[Sampled]:
        """One forward over every row; the tokens of the rows that sample, in order (a
        row with drafts: the drafts drawn, then the first draw that differs or follows
        them; its KV cut back to the row's last token and the drafts drawn)."""
        ...

    def can_speculate(self, request: Request) -> bool:
        """Whether the request's KV can be cut back after a verify (a sliding window
        that wrapped, an SSM state cannot)."""
        ...

    def snapshot(self, request: Request) -> SavedKV | None:
        """At a prefill chunk boundary: the KV as it is, when it could not be trimmed back
        to here later (None when it can, or cannot be saved)."""
        ...

    def release(self, request: Request) -> SavedKV | None:
        """The request is done (finished or cancelled): its KV freed, and returned
        for the prefix cache when worth keeping."""
        ...

    def peak_memory(self) -> int: ...


@dataclass(frozen=True)
class Budget:
    """The scheduler's limits, in tokens so every rank of a split agrees on them."""

    kv_tokens: int  # KV of running requests and the prefix cache together
    step_tokens: int  # tokens fed per step (prompt chunks and decode tokens)
    prefix_cache_tokens: int  # the prefix cache alone, at most
    # The most prompt tokens one request feeds a step; None: the step's.
    chunk_tokens: int | None = None
    # Of kv_tokens the running requests may hold at most this many (llama.cpp's context
    # cells; its prefix cache lives outside them). None: all of them.
    context_tokens: int | None = None
    # Tokens one forward computes at most (rows x its longest chunk), where the backend
    # runs a step's prompt chunks in several; None: the step's.
    forward_tokens: int | None = None
    # Query-key pairs of attention one forward may compute, where the scores are
    # materialized: the backend runs a step's prompt chunks in as many forwards as keep
    # within it, and a chunk is cut to fit alone. None: no limit.
    forward_area: int | None = None
    # For /state only: what the device gives this runner and what a token costs.
    budget_bytes: int = 0
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0


class Scheduler:
    def __init__(self, backend: Backend, budget: Budget) -> None:
        self.backend = backend
        self.budget = budget
        self.prefix_cache = PrefixCache(limits.PREFIX_CACHE_ENTRIES)
        self._queue: dict[CommandId, Request] = {}
        self._running: dict[CommandId, Request] = {}
        self._reserved = 0

    # --- requests in and out -----------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError when its prompt can never fit; caps its
        answer to the room it can have."""
        room = self.running_tokens - len(request.prompt)
        if room < 1:
            raise ValueError(
                f"the prompt's {len(request.prompt)} tokens do not fit: this instance holds "
                f"{self.running_tokens} tokens of prompt and answer at most"
            )
        # An answer ends ("length") where its room does, not in an error.
        request.answer.max_tokens = min(request.answer.max_tokens, room)
        # Admitted at the next step, with whatever else arrives before it: the backend
        # then makes room for them all at once (llama.cpp grows its context once).
        self._queue[request.request_id] = request

    def cancel(self, request_id: CommandId) -> None:
        if self._queue.pop(request_id, None) is not None:
            return
        request = self._running.get(request_id)
        if request is not None:
            self._finish(request)

    @property
    def running_tokens(self) -> int:
        """The most tokens of KV the running requests may hold together."""
        return min(self.budget.kv_tokens, self.budget.context_tokens or self.budget.kv_tokens)

    def shrink(self, context_tokens: int) -> None:
        """Fewer tokens fit than the budget said (a context that could not grow): every
        answer, queued or running, is capped to its room in the new one."""
        self.budget = replace(self.budget, context_tokens=context_tokens)
        for request in [*self._running.values(), *self._queue.values()]:
            answer = request.answer
            answer.max_tokens = max(1, min(answer.max_tokens, self.running_tokens - len(request.prompt)))

    @property
    def counts(self) -> tuple[int, int]:
        """Requests running (or admitted at the next step), and requests waiting for room."""
        starting = len(self._admissible())
        return len(self._running) + starting, len(self._queue) - starting

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._queue)

    def memory(self) -> RunnerMemory:
        return RunnerMemory(
            budget_bytes=self.budget.budget_bytes,
            weights_bytes=self.budget.weights_bytes,
            kv_bytes_per_token=self.budget.kv_bytes_per_token,
            kv_tokens=self.budget.kv_tokens,
            running_tokens=self.running_tokens,
            reserved_tokens=self._reserved,
            prefix_cache_tokens=self.prefix_cache.held_tokens,
            prefix_cache_bytes=self.prefix_cache.held_bytes,
        )

    # --- a step ------------------------------------------------------------------------

    def step(self) -> list[ChunkGenerated]:
        self._admit()
        rows = list(self._plan())
        if not rows:
            return []
        sampled = self.backend.run(rows)
        drawn = Counter(result.request.request_id for result in sampled)
        chunks: list[ChunkGenerated] = []
        for row in rows:
            request = row.request
            if not request.prefilling:
                # The row's last token and the drafts drawn are in its KV now.
                request.fed = row.start + drawn[request.request_id]
                if request.proposer is not None:
                    request.proposer.record(row.drafts, drawn[request.request_id] - 1)
                continue
            request.fed = row.start + len(row.tokens)
            chunks.append(
                ChunkGenerated(
                    command_id=request.request_id,
                    prefill=PrefillProgress(processed_tokens=request.fed, total_tokens=len(request.prompt)),
                )
            )
            if request.prefilling:
                saved = self.backend.snapshot(request)
                if saved is not None:
                    self.prefix_cache.remember_boundary(request.key[: saved.length], saved)
                    self._fit_prefix_cache()
            elif request.prefill_only:
                chunks.append(self._prefilled(request))
        for result in sampled:
            if result.request.request_id in self._running:  # not finished by an earlier draft
                chunks.append(self._token_chunk(result))
        return chunks

    def _admit(self) -> None:
        """Oldest first; one that does not fit holds the later ones back, so a long
        prompt is not starved by short ones."""
        admitted = self._admissible()
        if not admitted:
            return
        for request in admitted:
            request.reserved = len(request.prompt) + request.answer.max_tokens
            self._reserved += request.reserved
        self.backend.reserve(self._reserved)
        for request in admitted:
            # The last prompt token is always fed: its logits start the answer.
            cached = self.prefix_cache.find(request.key[: len(request.prompt) - 1])
            self._fit_prefix_cache(keep=cached[0] if cached else None)
            request.fed = request.cached_tokens = self.backend.open(request, cached)
            del self._queue[request.request_id]
            self._running[request.request_id] = request

    def _admissible(self) -> list[Request]:
        """The queued requests the next step admits."""
        admissible: list[Request] = []
        reserved = self._reserved
        for request in self._queue.values():
            if len(self._running) + len(admissible) >= limits.MAX_BATCH:
                break
            need = len(request.prompt) + request.answer.max_tokens
            if reserved + need > self.running_tokens and (self._running or admissible):
                break
            reserved += need
            admissible.append(request)
        return admissible

    def _fit_prefix_cache(self, keep: SavedKV | None = None) -> None:
        room = min(self.budget.prefix_cache_tokens, self.budget.kv_tokens - self._reserved)
        self.prefix_cache.evict(max(0, room), keep)

    def _plan(self) -> Iterator[Row]:
        """Every decoding request's last token, then prompt chunks oldest first, within
        the step's tokens (the first chunk takes a token at least), each cut to fit a
        forward's attention area alone."""
        budget = self.budget.step_tokens
        decoding = [request for request in self._running.values() if not request.prefilling]
        spare = budget - len(decoding)  # what drafts may take
        for request in decoding:
            drafts = self._drafts(request, spare)
            spare -= len(drafts)
            budget -= 1 + len(drafts)
            yield Row(request, request.output[-1:] + drafts, request.fed, True, len(drafts))
        for request in self._running.values():
            if budget <= 0:
                return
            if not request.prefilling:
                continue
            start = request.fed
            longest = min(budget, len(request.prompt) - start, self.budget.chunk_tokens or budget)
            end = self.backend.chunk_end(request, start, start + self._chunk_length(start, longest))
            budget -= end - start
            sample = end == len(request.prompt) and not request.prefill_only
            yield Row(request, request.prompt[start:end], start, sample)

    def _drafts(self, request: Request, spare: int) -> list[int]:
        """Proposals for a speculative request: within the step's spare tokens and its
        answer's room (the KV it reserved), none where its KV cannot be cut back."""
        if request.proposer is None or not self.backend.can_speculate(request):
            return []
        room = request.answer.max_tokens - request.answer.generated - 1
        return request.proposer.propose(min(spare, room))

    def _chunk_length(self, start: int, longest: int) -> int:
        """The longest chunk from `start`, at most `longest` tokens (1 at least), whose
        attention (its length x the positions it attends to) fits a forward's area."""
        area = self.budget.forward_area
        if area is None or longest * (start + longest) <= area:
            return longest
        # The positive root of length x (start + length) = area.
        length = int((math.sqrt(start * start + 4 * area) - start) / 2)
        while length > 1 and length * (start + length) > area:
            length -= 1
        return max(1, min(length, longest))

    # --- answers -----------------------------------------------------------------------

    def _token_chunk(self, result: Sampled) -> ChunkGenerated:
        request = result.request
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.output.append(result.token)
        if request.proposer is not None:
            request.proposer.extend([result.token])
        chunk = request.answer.feed(result.token, result.logprob)
        if chunk.finish_reason is None:
            return chunk
        self._finish(request)
        return chunk.model_copy(update={"usage": _usage(request), "stats": self._stats(request)})

    def _prefilled(self, request: Request) -> ChunkGenerated:
        """A prefill-only request whose prompt is in its KV: finished, its KV kept in the
        prefix cache (a later turn sent here prefills only what it adds)."""
        self._finish(request)
        return ChunkGenerated(command_id=request.request_id, finish_reason="stop", usage=_usage(request))

    def _finish(self, request: Request) -> None:
        del self._running[request.request_id]
        if request.output:
            # An answer that ended on a draft leaves the drafts after it in the KV.
            request.fed = min(request.fed, len(request.prompt) + len(request.output) - 1)
        self._reserved -= request.reserved
        if request.proposer is not None:
            request.proposer.close()
        saved = self.backend.release(request)
        if saved is not None and saved.length > 0:
            self.prefix_cache.remember((request.key + request.output)[: saved.length], saved)
            self._fit_prefix_cache()

    def _stats(self, request: Request) -> GenerationStats:
        now = time.perf_counter()
        first = request.first_token_at or now
        generated = request.answer.generated
        proposer = request.proposer
        return GenerationStats(
            prompt_tps=len(request.prompt) / max(first - request.submitted_at, 1e-9),
            generation_tps=(generated - 1) / max(now - first, 1e-9) if generated > 1 else 0.0,
            prompt_tokens=len(request.prompt),
            generation_tokens=generated,
            peak_memory_bytes=self.backend.peak_memory(),
            acceptance_rate=proposer.accepted / proposer.proposed if proposer and proposer.proposed else None,
            kv_handoff=request.kv_handoff,
        )


def _usage(request: Request) -> Usage:
    return Usage(
        prompt_tokens=len(request.prompt),
        completion_tokens=request.answer.generated,
        reasoning_tokens=request.answer.reasoning_tokens,
        cached_tokens=request.cached_tokens,
        proposed_tokens=request.proposer.proposed if request.proposer else 0,
        accepted_tokens=request.proposer.accepted if request.proposer else 0,
    )
