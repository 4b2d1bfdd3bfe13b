"""Model downloads from a Hugging Face hub: hub.py talks HTTP (retries, errors), verify.py
fetches one file and checks its hash, model.py downloads a model (or some of its layers) into a models dir."""

from exo.worker.download.hub import (
    DownloadError,
    HubBusy,
    HubUnreachable,
    InvalidModelId,
    ModelNeedsToken,
    ModelNotOnHub,
    hub_endpoint,
)
from exo.worker.download.model import download_model, fetch_card, wanted_file
from exo.worker.download.verify import FileCorrupt

__all__ = [
    "DownloadError",
    "FileCorrupt",
    "HubBusy",
    "HubUnreachable",
    "InvalidModelId",
    "ModelNeedsToken",
    "ModelNotOnHub",
    "download_model",
    "fetch_card",
    "hub_endpoint",
    "wanted_file",
]
