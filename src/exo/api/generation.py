"""The one flow every generation endpoint shares: place the model if auto-placement is on
and it has no instance (and wait for it to load), send a TextGeneration command, wait
until the master accepts it, stream its chunks, and finish the task when the stream ends
or the client leaves (which is also how generation is cancelled)."""

import asyncio
import time
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse
from loguru import logger

from exo.api.errors import ApiError
from exo.api.routers.cluster import card_or_404, node_of, place_model
from exo.master.master import least_loaded_instance
from exo.shared.models.model_cards import find_local_model_dir
from exo.shared.types.commands import TaskFinished, TextGeneration
from exo.shared.types.common import CommandId, InstanceId, ModelId
from exo.shared.types.runners import SERVING_STATUSES, RunnerFailed, RunnerLoading
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from exo.node import Node
    from exo.routing.chunk_streams import ChunkStreams

# A command can be lost while the cluster elects a new master; don't wait forever.
ACCEPT_TIMEOUT_SECONDS = 15.0
# How long a request waits for the model it placed to download, load and warm up.
PLACE_TIMEOUT_SECONDS = 3600.0
# A placed instance takes a moment to reach State; after that, a missing one is gone.
PLACEMENT_VISIBLE_SECONDS = 10.0
# Streams waiting for a model send a comment this often, so clients and proxies wait too.
KEEPALIVE_SECONDS = 2.0
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


async def wait_until_accepted(
    node: "Node", command_id: CommandId, queue: asyncio.Queue[ChunkGenerated]
) -> list[ChunkGenerated]:
    """Until the master has made a task of the command, or answered with a chunk (which
    is returned, taken off the queue)."""
    first_chunk = asyncio.ensure_future(queue.get())
    task_created = asyncio.ensure_future(
        node.replica.wait_for(lambda s: any(t.command_id == command_id for t in s.tasks.values()), timeout=3600)
    )
    done, _ = await asyncio.wait(
        {first_chunk, task_created}, timeout=ACCEPT_TIMEOUT_SECONDS, return_when=FIRST_COMPLETED
    )
    task_created.cancel()
    if first_chunk in done:
        return [first_chunk.result()]
    first_chunk.cancel()
    if not done:
        raise ApiError(
            503, "the cluster did not accept the request in time (is a master elected?); retry", code="not_accepted"
        )
    return []


def auto_place_enabled(node: "Node") -> bool:
    """The --auto-place / --no-auto-place flag, else on only in a one-node cluster."""
    if node.config.auto_place is not None:
        return node.config.auto_place
    return len(node.replica.state.nodes) == 1


def require_instance(request: Request, model: str) -> InstanceId | None:
    """None when an instance of the model serves; else the instance to wait for: one being
    loaded, or one placed now when auto-placement is on. A 404 (in the calling API's error
    shape) for an unknown model, or a known one not placed when auto-placement is off; a
    400 when the model cannot be placed."""
    node = node_of(request)
    card_or_404(node, model)
    state = node.replica.state
    if least_loaded_instance(state, ModelId(model)) is not None:
        return None
    if not auto_place_enabled(node):
        raise ApiError(
            404,
            f"model '{model}' has no running instance; place it first (POST /place_instance)",
            code="model_not_loaded",
            param="model",
        )
    loading = [i.instance_id for i in state.instances.values() if i.model_id == model]
    if loading:
        return loading[0]
    # Requests that arrive before the placed instance reaches State wait for it too.
    placing: dict[str, tuple[InstanceId, float]] = request.app.state.placing
    now = time.monotonic()
    if model in placing:
        instance_id, placed_at = placing[model]
        if now - placed_at < PLACEMENT_VISIBLE_SECONDS and instance_id not in state.instance_deletions:
            return instance_id
    instance_id = place_model(node, model).instance.instance_id
    placing[model] = (instance_id, now)
    logger.info(f"auto-placing {model} as instance {instance_id}")
    return instance_id


def prompt_token_count(tokenizer: "Tokenizer", params: TextGenerationTaskParams) -> int:
    """The tokens of the prompt's text, without the few a chat template adds."""
    if isinstance(params.prompt, list):
        return len(params.prompt)
    if isinstance(params.prompt, str):
        text = params.prompt
    else:
        parts: list[str] = []
        for message in params.messages:
            if isinstance(message.content, str):
                parts.append(message.content)
            elif message.content:
                parts += [str(part.get("text", "")) for part in message.content if isinstance(part, dict)]
            parts.append(message.reasoning_content or "")
        text = "\n".join(parts)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


# MLX seeds its generator with an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


def check_token_ids(ids: list[int], tokenizer: "Tokenizer | None") -> None:
    """A 400 for token ids no vocabulary has (or, with the tokenizer at hand, this one)."""
    vocab_size = tokenizer.get_vocab_size() if tokenizer is not None else None
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        limit = f" (the vocabulary has {vocab_size})" if vocab_size is not None else ""
        raise ApiError(
            400, f"prompt has token ids out of range{limit}: {bad[:5]}", code="invalid_prompt", param="prompt"
        )


# Content parts that carry media rather than text, as the adapters pass them on.
MEDIA_PARTS = {"image_url", "image", "input_image", "input_audio", "audio", "file", "input_file"}


def check_text_only(request: Request, params: TextGenerationTaskParams) -> None:
    """A 400 for images, audio or files: the engine runs models' text path only, and a
    model answering as if the picture were not there would mislead the user."""
    media = {
        part.get("type")
        for message in params.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.get("type") in MEDIA_PARTS
    }
    if not media:
        return
    card = node_of(request).cards().get(params.model)
    takes_images = card is not None and "vision" in card.capabilities
    reason = (
        "exo runs only its text path so far; vision input is not supported yet"
        if takes_images
        else "the model takes text only"
    )
    raise ApiError(
        400,
        f"{params.model} cannot read {', '.join(sorted(media))} content: {reason}",
        code="unsupported_content",
        param="messages",
    )


async def checked_params(request: Request, params: TextGenerationTaskParams) -> TextGenerationTaskParams:
    """Checks no adapter can make alone, and the ones where the model's tokenizer is local:
    a 400 for a prompt longer than the model's context, and no top_k at or over the
    vocabulary size (it keeps every token anyway, and the sampler refuses it)."""
    if params.prompt is None and not params.messages:
        raise ApiError(400, "the request has no messages to answer", code="invalid_request", param="messages")
    check_text_only(request, params)
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and {MAX_SEED}", code="invalid_request", param="seed")
    tokenizer = local_tokenizer(request, params.model)
    if isinstance(params.prompt, list):
        check_token_ids(params.prompt, tokenizer)
    if tokenizer is None:
        return params
    if params.top_k is not None and params.top_k >= tokenizer.get_vocab_size():
        params = params.model_copy(update={"top_k": None})
    card = node_of(request).cards().get(params.model)
    if card is None or not card.context_length:
        return params
    tokens = await asyncio.to_thread(prompt_token_count, tokenizer, params)
    if tokens > card.context_length:
        raise ApiError(
            400,
            f"prompt too long: {tokens} tokens, but {params.model} has a context of {card.context_length} tokens",
            code="context_length_exceeded",
            param="messages",
        )
    return params


def loading_comment(state: State, instance_id: InstanceId) -> str:
    """An SSE comment saying how far the instance's runners have loaded the model."""
    instance = state.instances.get(instance_id)
    runners = instance.shard_assignments.runner_to_shard if instance is not None else {}
    loading = [s for r in runners if isinstance(s := state.runners.get(r), RunnerLoading) and s.total_layers]
    if loading:
        done = sum(s.layers_loaded for s in loading)
        total = sum(s.total_layers for s in loading)
        return f": loading model {done}/{total} layers\n\n"
    return ": waiting\n\n"


class Generation:
    """One TextGeneration command and its chunk stream."""

    def __init__(self, node: "Node", streams: "ChunkStreams", params: TextGenerationTaskParams) -> None:
        self.node = node
        self.streams = streams
        self.command = TextGeneration(params=params, origin_session=node.session_id)
        self.command_id = self.command.command_id
        # Open before sending the command, so no chunk (nor a cancel) arrives unclaimed.
        self.queue = streams.open(self.command_id)
        self.early: list[ChunkGenerated] = []
        # The instance placed for this request, to wait for before sending the command.
        self.placing: InstanceId | None = None
        self._sent = False
        self._finished = False

    async def start(self) -> AsyncIterator[str]:
        """Waits for the instance being placed (yielding a keep-alive comment every few
        seconds), then sends the command and waits until the master accepts it. A cancel
        during the wait ends it without sending. Raises ApiError."""
        if self.placing is not None:
            async for comment in self._wait_for_instance(self.placing):
                yield comment
            self.placing = None
        # A stream calls this again once its response starts: send the command only once.
        if not self._sent and not self.early:
            self._sent = True
            self.node.send_command(self.command)
            self.early = await wait_until_accepted(self.node, self.command_id, self.queue)

    async def _wait_for_instance(self, instance_id: InstanceId) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        next_comment = started
        last_failure = ""
        first_chunk = asyncio.ensure_future(self.queue.get())
        try:
            while True:
                if first_chunk.done():
                    self.early = [first_chunk.result()]
                    return
                state = self.node.replica.state
                instance = state.instances.get(instance_id)
                now = loop.time()
                deleted = state.instance_deletions.get(instance_id)
                if instance is None and (deleted is not None or now - started > PLACEMENT_VISIBLE_SECONDS):
                    raise ApiError(
                        503,
                        f"the instance placed for '{self.command.params.model}' is gone before it served"
                        + (f": {deleted}" if deleted else "")
                        + (f"; its runner failed: {last_failure}" if last_failure else ""),
                        code="model_load_failed",
                    )
                if instance is not None:
                    statuses = [state.runners.get(r) for r in instance.shard_assignments.runner_to_shard]
                    if all(isinstance(s, SERVING_STATUSES) for s in statuses):
                        return
                    failures = [s.error_message for s in statuses if isinstance(s, RunnerFailed)]
                    last_failure = failures[0] if failures else last_failure
                if now - started > PLACE_TIMEOUT_SECONDS:
                    raise ApiError(503, "timed out waiting for the model to load", code="model_load_timeout")
                if now >= next_comment:
                    yield loading_comment(state, instance_id)
                    next_comment = now + KEEPALIVE_SECONDS
                changed = asyncio.ensure_future(
                    self.node.replica.wait_for(lambda s, seen=state: s is not seen, timeout=3600)
                )
                await asyncio.wait({first_chunk, changed}, timeout=next_comment - now, return_when=FIRST_COMPLETED)
                changed.cancel()
        finally:
            first_chunk.cancel()

    def chunks(self) -> AsyncIterator[ChunkGenerated]:
        return self.streams.until_finished(self.queue, self.early)

    def finish(self) -> None:
        """Idempotent; the master drops the task, which stops generation if it still runs."""
        if self._finished:
            return
        self._finished = True
        self.streams.close(self.command_id)
        self.node.send_command(TaskFinished(finished_command_id=self.command_id))

    async def collect(self, request: Request) -> list[ChunkGenerated]:
        """Every chunk of a non-streamed answer. A client that hangs up meanwhile cancels
        the generation, as closing a stream does; nobody reads the 499 then."""
        gathered = asyncio.ensure_future(self._gather())
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    raise ApiError(499, "the client closed the request", code="client_closed_request")
        finally:
            gathered.cancel()
            self.finish()

    async def _gather(self) -> list[ChunkGenerated]:
        return [chunk async for chunk in self.chunks()]


async def start_generation(request: Request, params: TextGenerationTaskParams, stream: bool = False) -> Generation:
    """A Generation whose command the master accepted; for a stream that waits for an
    instance being placed, the wait happens in stream_response (with keep-alives)."""
    params = await checked_params(request, params)
    placing = require_instance(request, params.model)
    generation = Generation(node_of(request), request.app.state.chunk_streams, params)
    generation.placing = placing
    if stream and placing is not None:
        return generation
    try:
        async for _ in generation.start():
            pass
    except BaseException:
        generation.finish()
        raise
    return generation


def stream_response(
    generation: Generation,
    encode: Callable[[AsyncIterator[ChunkGenerated]], AsyncIterator[str]],
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Streams encode(chunks); `finally` also runs when the client disconnects, and
    finishing the task then is what cancels the generation. While the model loads, SSE
    streams get keep-alive comments (NDJSON has no comments, so Ollama's get nothing);
    a failed load becomes the stream's error chunk."""

    async def body() -> AsyncIterator[str]:
        try:
            try:
                async for comment in generation.start():
                    if media_type == "text/event-stream":
                        yield comment
            except ApiError as error:
                generation.early = [
                    ChunkGenerated(command_id=generation.command_id, finish_reason="error", error_message=error.message)
                ]
            async for line in encode(generation.chunks()):
                yield line
        finally:
            generation.finish()

    return StreamingResponse(body(), media_type=media_type)


@lru_cache(maxsize=8)
def _tokenizer_at(path: Path) -> "Tokenizer | None":
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # missing or unreadable: callers fall back to an estimate
        return None


def local_tokenizer(request: Request, model: str) -> "Tokenizer | None":
    """The model's fast tokenizer when its files are on this node (the API process never
    loads the model itself), else None."""
    node = node_of(request)
    if model not in node.cards():
        return None
    model_dir = find_local_model_dir(model, node.config.exo_home)
    return _tokenizer_at(model_dir) if model_dir is not None else None


def generation_error(chunk: ChunkGenerated) -> ApiError:
    """The error for a generation that ended in one. A generation that ran to its end but
    whose output could not be parsed (a tool call left open or malformed) comes from the
    engine with its usage, and is a 422: the request was valid and the node is healthy,
    yet the model's answer cannot be given in the shape the request asked for (and SDKs,
    which retry 5xx, do not rerun it). A failed runner or a lost task has no usage: 500."""
    message = chunk.error_message or "generation failed"
    if chunk.usage is not None:
        return ApiError(422, f"the model's output could not be parsed: {message}", code="invalid_model_output")
    return ApiError(500, message, code="generation_failed")
