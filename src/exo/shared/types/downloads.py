"""Per-node download progress of a model's files."""

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel


class DownloadPending(FrozenModel):
    kind: Literal["DownloadPending"] = "DownloadPending"


class DownloadOngoing(FrozenModel):
    kind: Literal["DownloadOngoing"] = "DownloadOngoing"
    downloaded_bytes: int
    total_bytes: int
    bytes_per_second: float = 0.0


class DownloadCompleted(FrozenModel):
    kind: Literal["DownloadCompleted"] = "DownloadCompleted"
    total_bytes: int
    path: str
    # The model files the node holds there.
    files: list[str] = []
    # Layers [start, end) those files serve; None: the whole model.
    layers: tuple[int, int] | None = None

    def covers(self, start_layer: int, end_layer: int) -> bool:
        return self.layers is None or self.layers[0] <= start_layer and end_layer <= self.layers[1]


class DownloadFailed(FrozenModel):
    kind: Literal["DownloadFailed"] = "DownloadFailed"
    error_message: str


DownloadProgress = Annotated[
    DownloadPending | DownloadOngoing | DownloadCompleted | DownloadFailed,
    Field(discriminator="kind"),
]
