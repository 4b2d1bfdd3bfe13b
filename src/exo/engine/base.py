"""The small interface a runner drives. No MLX type crosses it, so another engine can
sit beside the MLX one."""

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from exo.shared.types.instances import Instance
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams

LayerProgress = Callable[[int, int], None]


class Engine(Protocol):
    def connect(self, instance: Instance, shard: ShardMetadata) -> None:
        """Join the instance's group of ranks (a no-op for a single rank)."""

    def load(self, model_dir: Path, shard: ShardMetadata, on_layer_loaded: LayerProgress) -> None: ...

    def warm_up(self) -> int:
        """Run a short generation so the first request pays no compile cost; returns
        the number of tokens generated."""

    def submit(self, request_id: str, params: TextGenerationTaskParams) -> None: ...

    def step(self) -> list[ChunkGenerated]:
        """Advance every active request by one token."""

    def cancel(self, request_id: str) -> None: ...

    @property
    def has_work(self) -> bool: ...

    def close(self) -> None: ...
