"""This node's verified model files, served to its peers as a Hugging Face hub would
(under /peer-hub, on the API port), so a node that needs a file takes it from a peer at
LAN speed before asking the hub.

Only the files this node's download record in State lists are served: those were
verified against the hub's hashes when they arrived. Listing and bytes use the hub's
shapes (`siblings` with size, blobId and lfs.sha256; Range on resolve), so the worker's
downloader reads a peer with the same code, and checks its bytes the same way."""

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from exo.api.port import ClusterDep, ClusterPort
from exo.shared.types.common import ModelId
from exo.shared.types.downloads import DownloadCompleted
from exo.worker.download.hub import PEER_HUB_PREFIX
from exo.worker.download.verify import file_hashes

router = APIRouter(prefix=PEER_HUB_PREFIX)


def _held(cluster: ClusterPort, model_id: str) -> tuple[Path, list[str]] | None:
    record = cluster.state.downloads.get(cluster.node_id, {}).get(ModelId(model_id))
    if not isinstance(record, DownloadCompleted):
        return None
    return Path(record.path), record.files


def _not_found(code: str) -> Response:
    return JSONResponse({"error": "not held by this node"}, status_code=404, headers={"X-Error-Code": code})


@router.get("/api/models/{org}/{name}/revision/{revision}", include_in_schema=False)
def peer_model_info(cluster: ClusterDep, org: str, name: str, revision: str) -> Response:
    held = _held(cluster, f"{org}/{name}")
    if held is None:
        return _not_found("RepoNotFound")
    directory, files = held
    siblings = []
    for file in files:
        sha256, blob = file_hashes(directory / file)
        size = (directory / file).stat().st_size
        lfs = {"size": size, "sha256": sha256} if file.endswith(".safetensors") else None
        siblings.append({"rfilename": file, "size": size, "blobId": blob, "lfs": lfs})
    return JSONResponse({"id": f"{org}/{name}", "sha": revision, "siblings": siblings})


@router.get("/{org}/{name}/resolve/{revision}/{path}", include_in_schema=False)
def peer_file(cluster: ClusterDep, org: str, name: str, revision: str, path: str, request: Request) -> Response:
    held = _held(cluster, f"{org}/{name}")
    if held is None:
        return _not_found("RepoNotFound")
    directory, files = held
    if path not in files:
        return _not_found("EntryNotFound")
    # FileResponse answers Range requests with 206.
    return FileResponse(directory / path, media_type="application/octet-stream")
