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
    # Seconds left at the current speed; None until there is a speed to go by.
    eta_seconds: float | None = None
    # The dir the files arrive in (verified ones under their own names, the one
    # streaming as `<name>.partial`), which the node's peer hub serves from as they arrive.
    path: str | None = None


class DownloadCompleted(FrozenModel):
    kind: Literal["DownloadCompleted"] = "DownloadCompleted"
    total_bytes: int
    path: str
    # The model files the node holds there.
    files: list[str] = []
    # Layers [start, end) those files serve; None: the whole model.
    layers: tuple[int, int] | None = None
    # The path is in a read-only models dir: exo never deletes these files.
    read_only: bool = False

    def covers(self, start_layer: int, end_layer: int) -> bool:
        return self.layers is None or self.layers[0] <= start_layer and end_layer <= self.layers[1]


class DownloadCancelled(FrozenModel):
    """Stopped by POST /download/cancel; the verified bytes stay on disk for a resume."""

    kind: Literal["DownloadCancelled"] = "DownloadCancelled"
    downloaded_bytes: int = 0
    total_bytes: int = 0


class DownloadFailed(FrozenModel):
    kind: Literal["DownloadFailed"] = "DownloadFailed"
    error_message: str


DownloadProgress = Annotated[
    DownloadPending | DownloadOngoing | DownloadCompleted | DownloadCancelled | DownloadFailed,
    Field(discriminator="kind"),
]

# What the API asked a node to do with a model's files, kept in State until done:
# "start" a download, "cancel" a running one, "delete" the files.
DownloadOrder = Literal["start", "cancel", "delete"]


class DownloadOrderEntry(FrozenModel):
    order: DownloadOrder
    # For "start": the layers [start, end) whose files to fetch; None: the whole model.
    layers: tuple[int, int] | None = None
