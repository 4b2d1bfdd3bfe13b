"""Disaggregated serving in a runner (engine/kv_handoff.py, engine/kv_wire.py): the
decode runner asks the prefill runner for a long prompt's KV and submits the request
once it is in; the prefill runner serves such asks beside its own requests. Both are
driven by the runner's stepping thread: `poll` takes what the socket threads queued,
so the engine is only ever touched from that thread."""

import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from loguru import logger

from exo.engine.kv_handoff import HandoffEngine, PartSink, offer_wanted
from exo.engine.kv_wire import FetchEnd, IncomingHandoff, KvFetch, KvServer, OfferWanted
from exo.shared.cluster_secret import secret_from_env
from exo.shared.types.common import CommandId
from exo.shared.types.instances import Instance
from exo.shared.types.text_generation import ChunkGenerated, KvHandoffStats, TextGenerationTaskParams


@dataclass
class _Waiting:
    params: TextGenerationTaskParams
    fetch: KvFetch
    sink: PartSink


class DecodeHandoffs:
    """Requests whose KV the prefill runner at `address` is computing."""

    def __init__(
        self,
        engine: HandoffEngine,
        address: tuple[str, int],
        secret: str | None,
        min_tokens: int,
        notify: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.address = address
        self.secret = secret
        self.min_tokens = min_tokens
        self.notify = notify
        self._waiting: dict[CommandId, _Waiting] = {}

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, command_id: CommandId, params: TextGenerationTaskParams) -> bool:
        """Ask for the request's KV if it is worth it; False: submit it at once."""
        handoff = self.engine.handoff_of(params, self.min_tokens)
        if handoff is None:
            return False
        sink = self.engine.kv_assembler(handoff)
        self._waiting[command_id] = _Waiting(params, KvFetch(self.address, handoff, self.secret, self.notify), sink)
        return True

    def cancel(self, command_id: CommandId) -> bool:
        waiting = self._waiting.pop(command_id, None)
        if waiting is None:
            return False
        waiting.fetch.close()  # the prefill runner sees the hang-up and stops prefilling
        return True

    def poll(self) -> list[tuple[CommandId, TextGenerationTaskParams]]:
        """The requests to submit now: their KV is in, or its fetch failed (they prefill
        here)."""
        ready: list[tuple[CommandId, TextGenerationTaskParams]] = []
        for command_id, waiting in list(self._waiting.items()):
            for item in waiting.fetch.take():
                if isinstance(item, OfferWanted):
                    waiting.fetch.offer(waiting.sink.held_parts(item.start))
                    continue
                if not isinstance(item, FetchEnd):
                    waiting.sink.add(item)
                    continue
                del self._waiting[command_id]
                self._finish(command_id, waiting, item)
                ready.append((command_id, waiting.params))
                break
        return ready

    def _finish(self, command_id: CommandId, waiting: _Waiting, end: FetchEnd) -> None:
        fetch = waiting.fetch
        if end.error is not None:
            logger.warning(f"prefilling {command_id} here: the prefill runner's KV did not come ({end.error})")
            return
        stats = KvHandoffStats(
            bytes=fetch.wire_bytes,
            seconds=fetch.seconds,
            prefill_seconds=end.prefill_seconds,
            tokens=fetch.handoff.sent_tokens,
            offered_tokens=fetch.offered_tokens,
        )
        try:
            self.engine.import_kv(command_id, waiting.sink, stats)
        except ValueError as error:
            logger.warning(f"prefilling {command_id} here: its KV was incomplete ({error})")
            return
        logger.info(
            f"{command_id}: KV of {stats.tokens} tokens in {stats.bytes} bytes, {stats.seconds:.3f} s "
            f"(prefill {stats.prefill_seconds:.3f} s; {stats.offered_tokens} cached tokens offered)"
        )


@dataclass
class _Receiving:
    """A handoff asked of this runner, waiting for the part of the decode side's prefix
    this engine's prefix cache lacks."""

    incoming: IncomingHandoff
    sink: PartSink


class PrefillService:
    """Handoffs asked of this runner, fed as prefill-only requests of its engine."""

    def __init__(self, engine: HandoffEngine, server: KvServer) -> None:
        self.engine = engine
        self.server = server
        self._serving: dict[CommandId, tuple[IncomingHandoff, float]] = {}
        self._receiving: dict[CommandId, _Receiving] = {}
        self._count = 0

    @property
    def serving(self) -> bool:
        return bool(self._serving or self._receiving)

    def poll(self, ready: bool = True) -> None:
        """Start what was asked (once what it wants of the decode side's prefix is in),
        and stop what the decode side hung up on; until the engine is `ready`, refuse
        what is asked (the decode side then prefills itself)."""
        for request_id, (incoming, _) in list(self._serving.items()):
            if incoming.abandoned.is_set():
                logger.info(f"{request_id}: the decode runner hung up, prefill stopped")
                self.engine.cancel(request_id)
                incoming.fail("the decode runner hung up")
                del self._serving[request_id]
        for request_id, receiving in list(self._receiving.items()):
            self._receive(request_id, receiving)
        while not self.server.incoming.empty():
            incoming = self.server.incoming.get_nowait()
            if not ready:
                incoming.fail("the prefill runner is not ready yet")
                continue
            self._count += 1
            request_id = CommandId(f"kv-handoff-{self._count}")
            try:
                wanted = offer_wanted(self.engine, incoming.handoff)
                if wanted is None:
                    self._start(request_id, incoming)
                    continue
                self._receiving[request_id] = _Receiving(incoming, self.engine.kv_assembler(wanted))
            except ValueError as error:
                incoming.fail(str(error))
                continue
            incoming.want(wanted.skip)

    def _receive(self, request_id: CommandId, receiving: _Receiving) -> None:
        """Take what came of the decode side's prefix; with all of it in, start."""
        incoming = receiving.incoming
        try:
            ended = _take_offered(incoming, receiving.sink)
            if not ended and not incoming.abandoned.is_set():
                return
            del self._receiving[request_id]
            if not ended:
                incoming.fail("the decode runner hung up")
                return
            self.engine.import_kv(request_id, receiving.sink)
            self._start(request_id, incoming)
        except ValueError as error:
            self._receiving.pop(request_id, None)
            incoming.fail(f"the decode side's prefix did not fit: {error}")

    def _start(self, request_id: CommandId, incoming: IncomingHandoff) -> None:
        self.engine.submit_prefill(request_id, incoming.handoff, incoming.send)
        self._serving[request_id] = (incoming, time.perf_counter())

    def finished(self, chunk: ChunkGenerated) -> bool:
        """Whether the chunk is one of this service's prefills (then it is handled here)."""
        served = self._serving.get(chunk.command_id)
        if served is None:
            return False
        if chunk.finish_reason is None:
            return True
        incoming, started = self._serving.pop(chunk.command_id)
        if chunk.finish_reason == "error":
            incoming.fail(chunk.error_message or "prefill failed")
        else:
            incoming.done(time.perf_counter() - started)
        return True

    def close(self) -> None:
        self.server.close()
        serving = [incoming for incoming, _ in self._serving.values()]
        for incoming in serving + [receiving.incoming for receiving in self._receiving.values()]:
            incoming.fail("the prefill runner stopped")
        self._serving.clear()
        self._receiving.clear()


def _take_offered(incoming: IncomingHandoff, sink: PartSink) -> bool:
    """What arrived of the decode side's offer, into `sink`; whether all of it has."""
    while True:
        try:
            part = incoming.offered.get_nowait()
        except queue.Empty:
            return False
        if part is None:
            return True
        sink.add(part)


def _host_and_port(host: str) -> tuple[str, int]:
    address, _, port = host.rpartition(":")
    return address.strip("[]"), int(port)


class RunnerHandoffs:
    """A runner's part in disaggregated serving, as its instance says: asking the prefill
    runner for long prompts' KV (`instance.prefill`), or prefilling for another instance
    (`instance.prefill_for`). The socket threads wake the runner when it waits idle."""

    def __init__(self, instance: Instance, engine: HandoffEngine) -> None:
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        secret = secret_from_env()
        self.decode: DecodeHandoffs | None = None
        self.prefill: PrefillService | None = None
        if instance.prefill is not None:
            address = _host_and_port(instance.prefill.host)
            self.decode = DecodeHandoffs(engine, address, secret, instance.prefill.min_tokens, self.wake)
        if instance.prefill_for is not None:
            self.prefill = PrefillService(engine, KvServer("", instance.prefill_for.port, secret, self.wake))

    def wake(self) -> None:
        try:
            self._wake_writer.send(b"w")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already waiting

    def wait(self, conn: Connection) -> None:
        """Until an instruction arrives on `conn` or a socket thread wakes the runner."""
        wait([conn, self._wake_reader])
        try:
            while self._wake_reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    @property
    def waiting(self) -> int:
        """Requests waiting for their KV."""
        return len(self.decode) if self.decode is not None else 0

    def start(self, command_id: CommandId, params: TextGenerationTaskParams) -> bool:
        return self.decode is not None and self.decode.start(command_id, params)

    def poll(self, ready: bool) -> list[tuple[CommandId, TextGenerationTaskParams]]:
        """Handoffs asked of this runner started; the requests whose KV came (or will
        not), to submit now."""
        if self.prefill is not None:
            self.prefill.poll(ready)
        return self.decode.poll() if self.decode is not None else []

    def finished(self, chunk: ChunkGenerated) -> bool:
        return self.prefill is not None and self.prefill.finished(chunk)

    def cancel(self, command_id: CommandId) -> bool:
        return self.decode is not None and self.decode.cancel(command_id)

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
