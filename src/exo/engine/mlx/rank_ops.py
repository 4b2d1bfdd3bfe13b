"""What rank 0 of a split instance tells the other ranks before each step: the requests
that start or are cancelled, the end of warm-up, shutdown. Every rank applies the same
list in the same order, so all of them plan the same batch."""

from typing import Annotated, Any, Literal

import mlx.core as mx
from pydantic import Field, TypeAdapter

from exo.engine.mlx.parallel import broadcast_bytes
from exo.shared.types.common import CommandId, FrozenModel
from exo.shared.types.text_generation import TextGenerationTaskParams


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


RankOp = Annotated[StartRequest | CancelRequest | EndWarmup | StopFollowers, Field(discriminator="op")]
_RANK_OPS = TypeAdapter(list[RankOp])


def agree_on_ops(ops: list[RankOp], group: mx.distributed.Group, stream: Any) -> list[RankOp]:
    """Rank 0's ops, on every rank (what another rank passes is not sent)."""
    received = broadcast_bytes(_RANK_OPS.dump_json(ops) if ops else None, group, stream)
    return _RANK_OPS.validate_json(received) if received else []
