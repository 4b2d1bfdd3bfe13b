"""The one flow every generation endpoint shares: check the request, place the model if
auto-placement is on and it has no instance (waiting for it to load), send a
TextGeneration command, wait until the master accepts it, then stream its chunks through
the API's encoder or collect them into one body. The task is finished when the stream
ends or the client leaves, which is also how generation is cancelled."""

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from loguru import logger

from exo.api.adapters.wire import SSE, Encoder
from exo.api.checks import checked_params
from exo.api.errors import ApiError
from exo.api.instance_watch import InstancesSeen, watch_instances
from exo.api.placing import AutoPlacer, card_or_404
from exo.api.port import ClusterPort
from exo.shared.queries import has_task_for, instances_of, is_serving, layers_loaded, weights_converted
from exo.shared.types.commands import TaskFinished, TextGeneration
from exo.shared.types.common import InstanceId
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams

# A command can be lost while the cluster elects a new master: send it again this often,
# and give up after the timeout (an election takes a few seconds).
RESEND_SECONDS = 3.0
ACCEPT_TIMEOUT_SECONDS = 20.0
# How long a request waits for the model it placed to download, load and warm up.
PLACE_TIMEOUT_SECONDS = 3600.0
# Streams waiting for a model send a comment this often, so clients and proxies wait too.
KEEPALIVE_SECONDS = 2.0
# What a 503 for a request no instance could take tells the client to wait.
RETRY_AFTER_SECONDS = 5
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


class Generation:
    """One TextGeneration command and its chunk stream."""

    def __init__(self, cluster: ClusterPort, params: TextGenerationTaskParams, placing: InstanceId | None) -> None:
        self.cluster = cluster
        self.command = TextGeneration(params=params, origin_session=cluster.session_id)
        self.command_id = self.command.command_id
        # Open before sending the command, so no chunk (nor a cancel) arrives unclaimed.
        self.queue = cluster.open_chunks(self.command_id)
        # Chunks taken off the queue while waiting (a cancel, or the master's refusal).
        self.early: list[ChunkGenerated] = []
        # The instance placed for this request, to wait for before sending the command.
        self.placing = placing
        self._sent = False
        self._finished = False
        self._rerouting_since: float | None = None
        # Instances this request was sent to that failed it: not tried again.
        self._failed_instances: set[InstanceId] = set()
        # Instances this node's State showed serving when the master found none did: not
        # tried until this node has seen them stop serving (its State caught up), so a
        # restarted runner serving again is tried.
        self._stale_instances: set[InstanceId] = set()

    async def start(self) -> AsyncIterator[str]:
        """Waits for the instance being placed (yielding a keep-alive comment every few
        seconds), then sends the command and waits until the master accepts it. A cancel
        during the wait ends it without sending. Raises ApiError."""
        if self.placing is not None:
            async for comment in self._wait_for_instance(self.placing):
                yield comment
            self.placing = None
        if not self._sent and not self.early:
            self._sent = True
            self.cluster.send_command(self.command)
            await self._wait_until_accepted()

    async def _wait_until_accepted(self) -> None:
        """Until the master has made a task of the command, or answered with a chunk. A
        command sent while the master was dying is lost: it is sent again every few
        seconds (the master ignores a copy of one it already took)."""
        first_chunk = asyncio.ensure_future(self.queue.get())
        accepted = asyncio.ensure_future(self.cluster.wait_for(lambda s: has_task_for(s, self.command_id), 3600))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACCEPT_TIMEOUT_SECONDS
        try:
            while loop.time() < deadline:
                done, _ = await asyncio.wait(
                    {first_chunk, accepted}, timeout=RESEND_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
                if first_chunk in done:
                    self.early = [first_chunk.result()]
                    return
                if accepted in done:
                    return
                self.cluster.send_command(self.command)
        finally:
            accepted.cancel()
            first_chunk.cancel()
        raise ApiError(
            503,
            "the cluster did not accept the request in time (is a master elected?); retry",
            code="not_accepted",
            retry_after=RETRY_AFTER_SECONDS,
        )

    async def _wait_for_instance(self, instance_id: InstanceId) -> AsyncIterator[str]:
        """Until the instance placed for this request serves, or the one the master placed
        in its stead (on MLX, or after a lost node); keep-alive comments meanwhile."""
        last_failure = ""
        next_comment = 0.0
        successor: InstanceId | None = None
        # Closed on return, so its pending read of the queue takes no chunk meant for later.
        async with aclosing(self._watch(instance_id=instance_id)) as watch:
            async for seen in watch:
                if seen.gone is not None and (others := instances_of(seen.state, self.command.params.model)):
                    successor = others[0].instance_id
                    break
                if seen.gone is not None:
                    raise ApiError(
                        503,
                        f"the instance placed for '{self.command.params.model}' is gone before it served: {seen.gone}"
                        + (f"; its runner failed: {last_failure}" if last_failure else ""),
                        code="model_load_failed",
                    )
                if seen.ready is not None:
                    return
                last_failure = next(iter(seen.failures), last_failure)
                if seen.waited > PLACE_TIMEOUT_SECONDS:
                    raise ApiError(503, "timed out waiting for the model to load", code="model_load_timeout")
                if seen.waited >= next_comment:
                    yield loading_comment(seen)
                    next_comment = seen.waited + KEEPALIVE_SECONDS
        if successor is not None:
            async for comment in self._wait_for_instance(successor):
                yield comment

    async def _route_again(self, failure: ChunkGenerated) -> AsyncIterator[str]:
        """The instance the request went to is gone (or none served) before a token came:
        wait for an instance of the model to serve, the one the master re-places after a
        lost node included, and send the command again under the same id. Raises a 503
        with Retry-After when none serves within the settings' reroute time."""
        loop = asyncio.get_running_loop()
        # One deadline over every attempt: this node's State may still show an instance
        # the master already knows is gone, and the master then refuses again.
        if self._rerouting_since is None:
            self._rerouting_since = loop.time()
        ran_on, stale = self._instances_that_failed_it()
        self._failed_instances |= ran_on
        self._stale_instances = stale
        limit = self.cluster.settings.reroute_seconds
        logger.info(f"request {self.command_id}: {failure.error_message}; routing it again")
        next_comment = 0.0
        found = False
        async with aclosing(self._watch(model_id=self.command.params.model)) as watch:
            async for seen in watch:
                waited = loop.time() - self._rerouting_since
                serving = {i.instance_id for i in seen.instances if is_serving(seen.state, i)}
                self._stale_instances &= serving
                if serving - self._failed_instances - self._stale_instances:
                    found = True
                    break
                if waited > limit:
                    raise ApiError(
                        503,
                        f"no instance of '{self.command.params.model}' could serve within {limit:.0f} s "
                        f"({failure.error_message}); retry later",
                        code="no_instance",
                        retry_after=RETRY_AFTER_SECONDS,
                    )
                if seen.waited >= next_comment:
                    yield loading_comment(seen)
                    next_comment = seen.waited + KEEPALIVE_SECONDS
        # Sent only once the watch is closed, so no chunk of the answer goes to its read.
        if found:
            self.cluster.send_command(self.command)
            await self._wait_until_accepted()

    def _instances_that_failed_it(self) -> tuple[set[InstanceId], set[InstanceId]]:
        """The instance this request's task ran on; without a task (the master found no
        instance), the ones this node still thinks serve, as stale: the master knows better."""
        state = self.cluster.state
        ran_on = {t.instance_id for t in state.tasks.values() if t.command_id == self.command_id}
        if ran_on:
            return ran_on, set()
        model = self.command.params.model
        return set(), {i.instance_id for i in instances_of(state, model) if is_serving(state, i)}

    async def _watch(self, instance_id: InstanceId | None = None, model_id: str | None = None):
        """Instances as they change, at least every keep-alive interval; ends with the
        first chunk that arrives meanwhile (a cancel), kept in `early`."""
        first_chunk = asyncio.ensure_future(self.queue.get())
        try:
            async for seen in watch_instances(self.cluster, instance_id, model_id, KEEPALIVE_SECONDS, first_chunk):
                yield seen
            self.early = [first_chunk.result()]
        finally:
            first_chunk.cancel()

    async def chunks(self) -> AsyncIterator[ChunkGenerated | str]:
        """The chunks until the one that finishes the generation, and keep-alive comments
        while the request is routed again. An error the cluster caused before the first
        token does not end the request: it is sent to another instance."""
        produced = False
        while True:
            chunk = self.early.pop(0) if self.early else await self.queue.get()
            if chunk.finish_reason == "error" and chunk.retryable and not produced:
                try:
                    async for comment in self._route_again(chunk):
                        yield comment
                except ApiError as error:
                    yield chunk.model_copy(update={"error_message": error.message})
                    return
                continue
            produced = produced or bool(chunk.text or chunk.reasoning or chunk.tool_calls)
            yield chunk
            if chunk.finish_reason is not None:
                return

    def finish(self) -> None:
        """Idempotent; the master drops the task, which stops generation if it still runs."""
        if self._finished:
            return
        self._finished = True
        self.cluster.close_chunks(self.command_id)
        self.cluster.send_command(TaskFinished(finished_command_id=self.command_id))

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
        return [chunk async for chunk in self.chunks() if isinstance(chunk, ChunkGenerated)]


async def start_generation(
    cluster: ClusterPort, placer: AutoPlacer, params: TextGenerationTaskParams, stream: bool
) -> Generation:
    """A Generation whose command the master accepted; for a stream that waits for an
    instance being placed, the wait happens in the stream (with keep-alives)."""
    card = card_or_404(cluster, params.model)
    params = await checked_params(cluster, card, params)
    generation = Generation(cluster, params, placer.require_instance(cluster, params.model))
    if stream and generation.placing is not None:
        return generation
    try:
        async for _ in generation.start():
            pass
    except BaseException:
        generation.finish()
        raise
    return generation


def stream_response(generation: Generation, encoder: Encoder) -> StreamingResponse:
    """Streams the encoder's events; `finally` also runs when the client disconnects, and
    finishing the task then is what cancels the generation. While the model loads, SSE
    streams get keep-alive comments (NDJSON has no comments, so Ollama's get nothing);
    a failed load becomes the stream's error chunk."""

    async def body() -> AsyncIterator[str]:
        try:
            try:
                async for comment in generation.start():
                    if encoder.media_type == SSE:
                        yield comment
            except ApiError as error:
                generation.early = [
                    ChunkGenerated(command_id=generation.command_id, finish_reason="error", error_message=error.message)
                ]
            for event in encoder.start():
                yield encoder.wire(event)
            async for chunk in generation.chunks():
                if isinstance(chunk, str):
                    if encoder.media_type == SSE:
                        yield chunk
                    continue
                for event in encoder.feed(chunk):
                    yield encoder.wire(event)
            yield encoder.closing
        finally:
            generation.finish()

    return StreamingResponse(body(), media_type=encoder.media_type)


async def respond(
    request: Request,
    cluster: ClusterPort,
    placer: AutoPlacer,
    params: TextGenerationTaskParams,
    encoder_for: Callable[[str], Encoder],
    stream: bool,
) -> StreamingResponse | dict[str, Any]:
    """Answer a generation request in the encoder's format: a stream, or one body.
    `encoder_for` gets the command id, which the APIs' response ids are made of."""
    generation = await start_generation(cluster, placer, params, stream)
    encoder = encoder_for(generation.command_id)
    if stream:
        return stream_response(generation, encoder)
    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    for chunk in chunks:
        encoder.feed(chunk)
    return encoder.body()


def loading_comment(seen: InstancesSeen) -> str:
    """An SSE comment saying how far the instance's runners have loaded the model."""
    converted = next((p for i in seen.instances if (p := weights_converted(seen.state, i)) is not None), None)
    if converted:
        return f": converting the weights for the engine {converted[0] * 100 // max(converted[1], 1)}%\n\n"
    progress = next((p for i in seen.instances if (p := layers_loaded(seen.state, i)) is not None), None)
    return f": loading model {progress[0]}/{progress[1]} layers\n\n" if progress else ": waiting\n\n"


def generation_error(chunk: ChunkGenerated) -> ApiError:
    """The error for a generation that ended in one. A generation that ran to its end but
    whose output could not be parsed (a tool call left open or malformed) comes from the
    engine with its usage, and is a 422: the request was valid and the node is healthy,
    yet the model's answer cannot be given in the shape the request asked for (and SDKs,
    which retry 5xx, do not rerun it). Input the model cannot take (`rejected`) is a 400.
    A failed runner or a lost task has no usage: 500."""
    message = chunk.error_message or "generation failed"
    if chunk.retryable:
        # The cluster's doing (an instance went away), never a 500.
        return ApiError(503, message, code="no_instance", retry_after=RETRY_AFTER_SECONDS)
    if chunk.rejected:
        return ApiError(400, message, code="unusable_input")
    if chunk.usage is not None:
        return ApiError(422, f"the model's output could not be parsed: {message}", code="invalid_model_output")
    return ApiError(500, message, code="generation_failed")
