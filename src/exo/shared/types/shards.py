"""Which part of a model one runner holds."""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import FrozenModel


class ShardBase(FrozenModel):
    model_card: ModelCard
    device_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    # Layer range [start_layer, end_layer) this rank runs.
    start_layer: int = Field(ge=0)
    end_layer: int
    n_layers: int = Field(ge=1)

    @model_validator(mode="after")
    def _check_ranges(self):
        if self.device_rank >= self.world_size:
            raise ValueError("device_rank must be below world_size")
        if not self.start_layer < self.end_layer <= self.n_layers:
            raise ValueError("need start_layer < end_layer <= n_layers")
        return self


class PipelineShardMetadata(ShardBase):
    """A contiguous layer range; activations flow rank r -> r+1."""

    kind: Literal["pipeline"] = "pipeline"


class TensorShardMetadata(ShardBase):
    """Every layer, with each weight matrix split across world_size ranks."""

    kind: Literal["tensor"] = "tensor"


ShardMetadata = Annotated[PipelineShardMetadata | TensorShardMetadata, Field(discriminator="kind")]
