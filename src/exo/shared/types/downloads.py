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


class DownloadFailed(FrozenModel):
    kind: Literal["DownloadFailed"] = "DownloadFailed"
    error_message: str


DownloadProgress = Annotated[
    DownloadPending | DownloadOngoing | DownloadCompleted | DownloadFailed,
    Field(discriminator="kind"),
]
