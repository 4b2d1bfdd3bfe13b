"""A tiny Hugging Face hub for tests and benchmarks (the fuzz script): serves the repos in `<root>/<org>--<name>/` on 127.0.0.1.

It answers the calls huggingface_hub makes to list and download a model repo:

- GET  /api/models?search=&limit=                       search: the repos whose id holds
  `search` (any case), as the real hub lists them (id, author, downloads, likes, tags)
- GET  /api/models/{org}/{name}[/revision/{revision}]   model info, with `siblings`
  carrying size, blobId and lfs (what `HfApi.model_info(files_metadata=True)` reads)
- GET  /api/models/{org}/{name}/tree/{revision}[/{path}] tree listing (`list_repo_tree`)
- HEAD /{org}/{name}/resolve/{revision}/{path}          ETag, X-Repo-Commit, Content-Length
- GET  /{org}/{name}/resolve/{revision}/{path}          the bytes, with Range support

Unknown repos answer 404 with `X-Error-Code: RepoNotFound`, unknown files 404 with
`X-Error-Code: EntryNotFound`, as the real hub does. The commit of a repo is a hash of its
file names, sizes and mtimes; a file's ETag is the sha256 of its content.

Knobs a test can turn while the hub runs (attributes of `FakeHub`):
- `throttle_bytes_per_second`: slows file bodies down, so progress can be watched.
- `throttle_files`: repo-relative path -> bytes per second for that file alone (over the
  one above), so one file arrives after others that began later.
- `missing_files`: repo-relative paths that stay listed but 404 on download.
- `die_after_bytes`: after sending this many bytes of one file body, the hub drops the
  connection and shuts down for good (a hub dying mid-file).
- `corrupt_files`: repo-relative paths served with one byte flipped (same size, same
  listed hashes), every time they are asked for.
- `busy_answers` / `retry_after`: the next `busy_answers` requests, whatever they ask,
  answer `busy_status` (429, or a 5xx) with `Retry-After: retry_after` (counted down);
  with `busy_match` set, only requests whose path contains it.
- `gated_repos`: repo ids answering 401 with `X-Error-Code: GatedRepo` to every call.
- `body_bytes_sent`: file body bytes sent so far, all files and repos together.

File responses carry the real hub's headers: `ETag` (the git blob id, or the sha256 for
LFS files, which also get `X-Linked-Etag` and `X-Linked-Size`), `Content-Length`,
`Accept-Ranges`, and `Content-Range` on a 206.
"""

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

CHUNK_BYTES = 64 * 1024


class _ServerDied(Exception):
    """Raised inside a response body to drop the connection (die_after_bytes)."""


class FakeHub:
    def __init__(self, root: Path, throttle_bytes_per_second: float | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.throttle_bytes_per_second = throttle_bytes_per_second
        self.throttle_files: dict[str, float] = {}
        self.missing_files: set[str] = set()
        self.die_after_bytes: int | None = None
        self.corrupt_files: set[str] = set()
        self.busy_answers = 0
        self.retry_after: float = 1
        self.busy_status = 429
        self.busy_match = ""
        self.gated_repos: set[str] = set()
        # (method, path) of every request, for tests that check what was (not) fetched.
        self.requests: list[tuple[str, str]] = []
        self.body_bytes_sent = 0
        self.endpoint = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._hashes: dict[tuple[str, int, int], tuple[str, str]] = {}
        self.app = self._make_app()

    # `endpoint, root = fake_hub`
    def __iter__(self) -> Iterator:
        return iter((self.endpoint, self.root))

    # -- repo contents ---------------------------------------------------------------

    def repo_dir(self, repo_id: str) -> Path | None:
        org, _, name = repo_id.partition("/")
        path = self.root / f"{org}--{name}"
        return path if org and name and path.is_dir() else None

    @staticmethod
    def repo_files(repo_dir: Path) -> list[str]:
        return sorted(
            path.relative_to(repo_dir).as_posix()
            for path in repo_dir.rglob("*")
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(repo_dir).parts)
        )

    def _file_hashes(self, path: Path) -> tuple[str, str]:
        """(sha256, git blob sha1) of a file, cached by name, size and mtime."""
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._hashes:
            sha256, blob = hashlib.sha256(), hashlib.sha1(f"blob {stat.st_size}\0".encode())
            with path.open("rb") as file:
                while chunk := file.read(1 << 20):
                    sha256.update(chunk)
                    blob.update(chunk)
            self._hashes[key] = (sha256.hexdigest(), blob.hexdigest())
        return self._hashes[key]

    def commit(self, repo_dir: Path) -> str:
        digest = hashlib.sha1()
        for name in self.repo_files(repo_dir):
            stat = (repo_dir / name).stat()
            digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    @staticmethod
    def last_modified(repo_dir: Path) -> str:
        return datetime.fromtimestamp(repo_dir.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")

    def _file_entry(self, repo_dir: Path, name: str) -> dict:
        path = repo_dir / name
        size = path.stat().st_size
        sha256, blob = self._file_hashes(path)
        lfs = {"size": size, "sha256": sha256, "pointerSize": 134} if name.endswith(".safetensors") else None
        return {"rfilename": name, "size": size, "blobId": blob, "lfs": lfs}

    # -- app -------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI()
        hub = self

        @app.middleware("http")
        async def busy_or_gated(request: Request, call_next):
            parts = request.url.path.removeprefix("/api/models").strip("/").split("/")
            if "/".join(parts[:2]) in hub.gated_repos:
                hub.requests.append((request.method, request.url.path))
                return JSONResponse(
                    {"error": "Access to this model is restricted. You must be authenticated."},
                    status_code=401,
                    headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"},
                )
            if hub.busy_answers > 0 and hub.busy_match in request.url.path:
                hub.busy_answers -= 1
                hub.requests.append((request.method, request.url.path))
                return JSONResponse(
                    {"error": "busy"}, status_code=hub.busy_status, headers={"Retry-After": f"{hub.retry_after:g}"}
                )
            return await call_next(request)

        def repo_not_found() -> Response:
            return JSONResponse(
                {"error": "Repository not found"},
                status_code=404,
                headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
            )

        @app.get("/api/models")
        async def search(request: Request, search: str = "", limit: int = 1000) -> Response:
            hub.requests.append((request.method, request.url.path))
            found = []
            for repo_dir in sorted(p for p in hub.root.iterdir() if p.is_dir() and "--" in p.name):
                repo_id = repo_dir.name.replace("--", "/", 1)
                if search.lower() in repo_id.lower():
                    modified = hub.last_modified(repo_dir)
                    org = repo_id.split("/")[0]
                    found.append(
                        {
                            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                            "id": repo_id,
                            "modelId": repo_id,
                            "author": org,
                            "downloads": len(hub.repo_files(repo_dir)),
                            "likes": 0,
                            "tags": ["safetensors"],
                            "lastModified": modified,
                            "private": False,
                        }
                    )
            return JSONResponse(found[:limit])

        @app.get("/api/models/{org}/{name}")
        @app.get("/api/models/{org}/{name}/revision/{revision:path}")
        async def model_info(org: str, name: str, request: Request, revision: str = "main") -> Response:
            hub.requests.append((request.method, request.url.path))
            repo_id = f"{org}/{name}"
            repo_dir = hub.repo_dir(repo_id)
            if repo_dir is None:
                return repo_not_found()
            siblings = [hub._file_entry(repo_dir, file) for file in hub.repo_files(repo_dir)]
            modified = hub.last_modified(repo_dir)
            return JSONResponse(
                {
                    "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "author": org,
                    "sha": hub.commit(repo_dir),
                    "lastModified": modified,
                    "createdAt": modified,
                    "private": False,
                    "disabled": False,
                    "gated": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "siblings": siblings,
                    "usedStorage": sum(sibling["size"] for sibling in siblings),
                }
            )

        @app.get("/api/models/{org}/{name}/tree/{revision}")
        @app.get("/api/models/{org}/{name}/tree/{revision}/{path:path}")
        async def tree(
            org: str, name: str, revision: str, request: Request, path: str = "", recursive: bool = False
        ) -> Response:
            hub.requests.append((request.method, request.url.path))
            repo_dir = hub.repo_dir(f"{org}/{name}")
            if repo_dir is None:
                return repo_not_found()
            prefix = f"{path.strip('/')}/" if path.strip("/") else ""
            entries: list[dict] = []
            folders: set[str] = set()
            for file in hub.repo_files(repo_dir):
                if not file.startswith(prefix):
                    continue
                rest = file[len(prefix) :]
                if "/" in rest and not recursive:
                    folders.add(prefix + rest.split("/")[0])
                    continue
                if recursive:
                    parts = rest.split("/")[:-1]
                    folders.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
                entry = hub._file_entry(repo_dir, file)
                lfs = entry["lfs"]
                entries.append(
                    {
                        "type": "file",
                        "oid": entry["blobId"],
                        "size": entry["size"],
                        "path": file,
                        **({"lfs": {"oid": lfs["sha256"], "size": lfs["size"], "pointerSize": 134}} if lfs else {}),
                    }
                )
            folder_entries = [
                {"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                for f in sorted(folders)
            ]
            return JSONResponse(folder_entries + entries)

        @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve(org: str, name: str, revision: str, path: str, request: Request) -> Response:
            hub.requests.append((request.method, request.url.path))
            repo_dir = hub.repo_dir(f"{org}/{name}")
            if repo_dir is None:
                return repo_not_found()
            commit = hub.commit(repo_dir)
            file = repo_dir / path
            if path in hub.missing_files or path not in hub.repo_files(repo_dir):
                return JSONResponse(
                    {"error": "Entry not found"},
                    status_code=404,
                    headers={
                        "X-Error-Code": "EntryNotFound",
                        "X-Error-Message": "Entry not found",
                        "X-Repo-Commit": commit,
                    },
                )
            size = file.stat().st_size
            sha256, blob = hub._file_hashes(file)
            lfs = path.endswith(".safetensors")
            headers = {
                "ETag": f'"{sha256 if lfs else blob}"',
                **({"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(size)} if lfs else {}),
                "X-Repo-Commit": commit,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{Path(path).name}"',
            }
            start, end, status = 0, size - 1, 200
            range_header = request.headers.get("range")
            if range_header and range_header.startswith("bytes="):
                first, _, last = range_header[len("bytes=") :].split(",")[0].partition("-")
                start = int(first) if first else max(size - int(last), 0)
                end = int(last) if first and last else size - 1
                if start >= size:
                    return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
                end = min(end, size - 1)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            headers["Content-Length"] = str(end - start + 1)
            if request.method == "HEAD":
                return Response(status_code=status, headers=headers)
            corrupt = path in hub.corrupt_files
            throttle = hub.throttle_files.get(path)
            body = hub._body(file, start, end, corrupt, throttle)
            return StreamingResponse(body, status_code=status, headers=headers)

        return app

    async def _body(
        self, path: Path, start: int, end: int, corrupt: bool = False, throttle: float | None = None
    ) -> AsyncIterator[bytes]:
        sent = 0
        with path.open("rb") as file:
            file.seek(start)
            remaining = end - start + 1
            while remaining > 0:
                chunk = file.read(min(CHUNK_BYTES, remaining))
                if not chunk:
                    break
                if corrupt and sent == 0:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                if self.die_after_bytes is not None and sent + len(chunk) > self.die_after_bytes:
                    yield chunk[: max(self.die_after_bytes - sent, 0)]
                    if self._server is not None:
                        self._server.should_exit = True
                    raise _ServerDied("fake hub died mid-file")
                remaining -= len(chunk)
                sent += len(chunk)
                self.body_bytes_sent += len(chunk)
                yield chunk
                if rate := throttle or self.throttle_bytes_per_second:
                    await asyncio.sleep(len(chunk) / rate)

    # -- running ---------------------------------------------------------------------

    def start(self) -> "FakeHub":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake hub did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


@contextlib.contextmanager
def running_fake_hub(root: Path, throttle_bytes_per_second: float | None = None) -> Iterator[FakeHub]:
    hub = FakeHub(root, throttle_bytes_per_second).start()
    try:
        yield hub
    finally:
        hub.stop()
