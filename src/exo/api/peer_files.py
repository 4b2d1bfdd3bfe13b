"""This node's verified model files, served to its peers as a Hugging Face hub would
(under /peer-hub, on the API port), so a node that needs a file takes it from a peer at
LAN speed before asking the hub.

Only the files this node's download record in State lists are served: those were
verified against the hub's hashes when they arrived. Listing and bytes use the hub's
shapes (`siblings` with size, blobId and lfs.sha256; Range on resolve), so the worker's
downloader reads a peer with the same code, and checks its bytes the same way.

A file still arriving here (this node takes it from the hub for every node that needs
it, shared/queries.py's `hub_fetcher`) is served as it arrives: the bytes written so far
of its `.partial`, then each new one, until the file is verified under its own name. If
the download stops first (failed, cancelled, or the bytes were dropped after a failed
check), the answer breaks off without its last chunk, so the reader sees a broken
transfer and resumes with Range, or goes to the hub. The reader checks the whole file
against the hub's hash either way."""

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from exo.api.port import ClusterDep, ClusterPort
from exo.shared.queries import download_running, nodes_fetching
from exo.shared.types.common import ModelId
from exo.shared.types.downloads import DownloadCompleted, DownloadOngoing
from exo.worker.download.hub import NOT_ARRIVED_YET, PEER_HUB_PREFIX
from exo.worker.download.verify import PARTIAL_SUFFIX, file_hashes

router = APIRouter(prefix=PEER_HUB_PREFIX)

# How long a request for a file this node is about to fetch waits for it to start
# arriving (under the reader's 30 s read timeout); then 404 NotArrivedYet and the reader
# asks again, or the hub if this node has stopped fetching.
ARRIVAL_WAIT_SECONDS = 20.0
# A file that stops growing this long while its download still runs: the answer breaks off.
STALL_SECONDS = 25.0
POLL_SECONDS = 0.02
CHUNK_BYTES = 1 << 20


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
async def peer_file(cluster: ClusterDep, org: str, name: str, revision: str, path: str, request: Request) -> Response:
    model_id = f"{org}/{name}"
    held = _held(cluster, model_id)
    if held is None or path not in held[1] and _fetching(cluster, model_id):
        if "/" in path or not _fetching(cluster, model_id):
            return _not_found("RepoNotFound")
        return await _serve_arriving(cluster, model_id, path, request)
    directory, files = held
    if path not in files:
        return _not_found("EntryNotFound")
    # FileResponse answers Range requests with 206.
    return FileResponse(directory / path, media_type="application/octet-stream")


class _Broken(Exception):
    """Raised inside a streaming answer to break it off without its last chunk."""


def _arriving_dir(cluster: ClusterPort, model_id: str) -> Path | None:
    record = cluster.state.downloads.get(cluster.node_id, {}).get(ModelId(model_id))
    return Path(record.path) if isinstance(record, DownloadOngoing) and record.path else None


def _fetching(cluster: ClusterPort, model_id: str) -> bool:
    """This node is downloading the model, or State says it is about to."""
    state = cluster.state
    return download_running(state, cluster.node_id, model_id) or cluster.node_id in nodes_fetching(state, model_id)


def _range_start(request: Request) -> int:
    unit, _, spec = request.headers.get("range", "").partition("=")
    first = spec.partition("-")[0].strip()
    return int(first) if unit.strip() == "bytes" and first.isdigit() else 0


async def _open_arriving(cluster: ClusterPort, model_id: str, name: str) -> tuple[int, int] | None:
    """(fd, inode) of the file as it arrives, or None once it is held whole or will not come."""
    deadline = time.monotonic() + ARRIVAL_WAIT_SECONDS
    while time.monotonic() < deadline and _fetching(cluster, model_id):
        directory = _arriving_dir(cluster, model_id)
        if directory is not None:
            for path in (directory / (name + PARTIAL_SUFFIX), directory / name):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                return fd, os.fstat(fd).st_ino
        await asyncio.sleep(POLL_SECONDS * 5)
    return None


def _verified(cluster: ClusterPort, model_id: str, name: str, inode: int) -> bool:
    """The file open as `inode` is now this node's verified copy (renamed to its own name,
    in the download dir or the model dir it became)."""
    record = cluster.state.downloads.get(cluster.node_id, {}).get(ModelId(model_id))
    dirs = [d for d in (_arriving_dir(cluster, model_id),) if d is not None]
    if isinstance(record, DownloadCompleted):
        dirs.append(Path(record.path))
    for directory in dirs:
        try:
            if (directory / name).stat().st_ino == inode:
                return True
        except FileNotFoundError:
            continue
    return False


async def _follow(
    cluster: ClusterPort, model_id: str, name: str, fd: int, inode: int, start: int
) -> AsyncIterator[bytes]:
    try:
        offset, last_growth = start, time.monotonic()
        while True:
            chunk = os.pread(fd, CHUNK_BYTES, offset)
            if chunk:
                offset += len(chunk)
                last_growth = time.monotonic()
                yield chunk
                continue
            if os.fstat(fd).st_size < offset or os.fstat(fd).st_nlink == 0:
                raise _Broken(f"{name} of {model_id} was dropped while it arrived")
            if _verified(cluster, model_id, name, inode):
                if os.fstat(fd).st_size == offset:
                    return
                continue
            if not download_running(cluster.state, cluster.node_id, model_id):
                raise _Broken(f"the download of {model_id} stopped before {name} arrived whole")
            if time.monotonic() - last_growth > STALL_SECONDS:
                raise _Broken(f"{name} of {model_id} stopped arriving")
            await asyncio.sleep(POLL_SECONDS)
    finally:
        os.close(fd)


async def _serve_arriving(cluster: ClusterPort, model_id: str, name: str, request: Request) -> Response:
    opened = await _open_arriving(cluster, model_id, name)
    if opened is None:
        held = _held(cluster, model_id)  # it may have finished meanwhile
        if held is not None and name in held[1]:
            return FileResponse(held[0] / name, media_type="application/octet-stream")
        # Still fetching, so it will come: the reader asks again rather than the hub.
        return _not_found(NOT_ARRIVED_YET if _fetching(cluster, model_id) else "EntryNotFound")
    start = _range_start(request)
    return StreamingResponse(
        _follow(cluster, model_id, name, *opened, start),
        status_code=206 if start else 200,
        media_type="application/octet-stream",
        headers={"Accept-Ranges": "bytes", **({"Content-Range": f"bytes {start}-*/*"} if start else {})},
    )
