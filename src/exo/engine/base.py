"""What a second engine must implement: the whole interface a runner drives
(exo.worker.runner uses nothing else). No MLX type crosses it.

A runner calls connect, load and warm_up once each, in that order; then submit and
cancel as requests come and go, and step while has_work; close at the end. On a
multi-rank instance only rank 0 takes requests: a follower rank, once warmed up, just
calls step until shutdown_requested (its engine learns what to do from rank 0)."""

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerMemory
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, TextGenerationTaskParams

LayerProgress = Callable[[int, int], None]
# (bytes written, bytes in all) of a conversion of the weights before they load.
ConvertProgress = Callable[[int, int], None]


class Engine(Protocol):
    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        """Join the instance's group of ranks (a no-op for a single rank)."""
        ...

    def load(
        self,
        model_dir: Path,
        shard: ShardMetadata,
        on_layer_loaded: LayerProgress,
        on_converted: ConvertProgress | None = None,
    ) -> None:
        """Load this rank's part of the model; on_layer_loaded(done, total) reports progress,
        and on_converted(done, total) that of converting the weights first, if the engine
        does."""
        ...

    def load_draft(self, model_dir: Path, model_id: str) -> None:
        """Load the instance's draft model for speculative decoding (rank 0, after load).
        An engine without draft models leaves requests that ask for one to fail at submit."""
        ...

    def warm_up(self) -> int:
        """Run a short generation so the first request pays no compile cost; returns
        the number of tokens generated. Every rank calls it; rank 0 leads."""
        ...

    def submit(self, request_id: CommandId, params: TextGenerationTaskParams) -> None:
        """Start a request (rank 0 only). Raises ValueError for a request it cannot run,
        before any rank starts it."""
        ...

    def step(self) -> list[ChunkGenerated]:
        """Advance every active request by one prefill chunk or one token; a finished
        request's last chunk has its finish_reason set. On a follower, the chunks are
        not streamed."""
        ...

    def cancel(self, request_id: CommandId) -> None:
        """Stop a request (rank 0 only); it yields no more chunks."""
        ...

    @property
    def request_counts(self) -> tuple[int, int]:
        """Requests being stepped, and requests waiting for room (rank 0)."""
        ...

    @property
    def memory(self) -> RunnerMemory | None:
        """The runner's memory budget and what holds it (rank 0; None before load)."""
        ...

    @property
    def has_work(self) -> bool:
        """Requests are active, or changes wait for the next step."""
        ...

    @property
    def is_follower(self) -> bool:
        """A rank after 0 of a multi-rank group: it steps in lockstep with rank 0 and
        neither takes requests nor streams tokens."""
        ...

    @property
    def shutdown_requested(self) -> bool:
        """On a follower: rank 0 has closed, so this rank should close too."""
        ...

    def close(self) -> None:
        """Free the model; on rank 0 of a group, also tell the followers to stop."""
        ...


def generate_warmup(engine: Engine) -> int:
    """A short greedy request, stepped until it ends (what an engine's warm_up runs on
    rank 0); returns the tokens generated."""
    params = TextGenerationTaskParams(
        model=ModelId("warmup"),
        messages=[ChatMessage(role="user", content="Hello")],
        max_tokens=4,
        temperature=0.0,
    )
    engine.submit(CommandId("warmup"), params)
    generated = 0
    while engine.has_work:
        generated += sum(len(chunk.token_ids) for chunk in engine.step())
    return generated
