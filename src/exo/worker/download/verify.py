"""One file of a model, fetched into a dir and checked against the hub's hash while it
streams.

The bytes go to `<name>.partial` beside their final place; a restarted download (after a
cancel, a crash, a kill -9) hashes what that file holds and asks the hub only for the rest
(Range). Only a file whose hash matches is renamed to its own name, so a file under its
own name in a download dir has been verified. A mismatch deletes the partial file and
downloads once more from zero; a second mismatch is reported, naming the file."""

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from loguru import logger

from exo.worker.download.hub import Call, DownloadError, RepoFile, stream_file

PARTIAL_SUFFIX = ".partial"
READ_CHUNK_BYTES = 1 << 20


class FileCorrupt(DownloadError):
    """A file's bytes did not match the hub's hash, twice."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


class _Hasher:
    """The hub's kind of hash for a file: sha256 for LFS files, git's blob sha1 for the rest."""

    def __init__(self, file: RepoFile) -> None:
        self.expected: str | None = file.sha256 or file.blob_id
        self._digest: Any
        if file.sha256:
            self._digest = hashlib.sha256()
        elif file.blob_id and file.size is not None:
            self._digest = hashlib.sha1(f"blob {file.size}\0".encode())
        else:
            self._digest = None

    def update(self, data: bytes) -> None:
        if self._digest is not None:
            self._digest.update(data)

    def actual(self) -> str | None:
        return self._digest.hexdigest() if self._digest is not None else None


def _hash_existing(path: Path, hasher: _Hasher) -> int:
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(READ_CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return size


def _stream_once(
    http: httpx.Client,
    call: Call,
    revision: str,
    file: RepoFile,
    partial: Path,
    cancel: threading.Event,
    on_bytes: Callable[[int], None],
) -> _Hasher:
    hasher = _Hasher(file)
    if partial.is_file() and file.size is not None and partial.stat().st_size > file.size:
        partial.unlink()  # longer than the file: not ours to resume
    held = _hash_existing(partial, hasher) if partial.is_file() else 0
    on_bytes(held)
    # Unbuffered: what the hub sent is on disk (in the page cache) even if this process dies.
    out = partial.open("ab", buffering=0)
    written = held

    def write(chunk: bytes) -> None:
        nonlocal written
        out.write(chunk)
        hasher.update(chunk)
        written += len(chunk)
        on_bytes(len(chunk))

    def restart() -> None:
        nonlocal hasher, written
        out.truncate(0)
        out.seek(0)
        on_bytes(-written)
        hasher, written = _Hasher(file), 0

    try:
        stream_file(http, call, revision, write, lambda: written, restart, cancel)
    except BaseException:
        # The next attempt (another source, or the same peer asked again) counts what
        # the partial file holds afresh.
        on_bytes(-written)
        raise
    finally:
        out.close()
    return hasher


def fetch_verified(
    http: httpx.Client,
    call: Call,
    revision: str,
    file: RepoFile,
    directory: Path,
    cancel: threading.Event,
    on_bytes: Callable[[int], None],
) -> Path:
    """Downloads `file` into `directory` and returns its path once its hash matches.
    `on_bytes(n)` is told of every n bytes added (negative when bytes are dropped)."""
    path = directory / file.name
    partial = partial_path(path)
    for attempt in (1, 2):
        hasher = _stream_once(http, call, revision, file, partial, cancel, on_bytes)
        size = partial.stat().st_size
        actual = hasher.actual()
        if hasher.expected is None:
            logger.warning(f"{call.endpoint} lists no hash for {file.name} of {call.model_id}; stored unverified")
        if (file.size is None or size == file.size) and (hasher.expected is None or actual == hasher.expected):
            os.replace(partial, path)
            return path
        on_bytes(-size)
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        detail = f"{size} bytes, hash {actual}; the hub lists {file.size} bytes, hash {hasher.expected}"
        if attempt == 2:
            raise FileCorrupt(
                f"file {file.name} of model {call.model_id} failed verification twice and was deleted ({detail})"
            )
        logger.warning(f"{file.name} of {call.model_id} failed verification ({detail}); downloading it again")
    raise AssertionError("unreachable")


_HASHES: dict[tuple[str, int, int], tuple[str, str]] = {}


def file_hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob id) of a file, as a hub lists them; cached by path, size and mtime
    (a peer serving its files lists them on every request)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        sha256, blob = hashlib.sha256(), hashlib.sha1(f"blob {stat.st_size}\0".encode())
        with path.open("rb") as file:
            while chunk := file.read(READ_CHUNK_BYTES):
                sha256.update(chunk)
                blob.update(chunk)
        _HASHES[key] = (sha256.hexdigest(), blob.hexdigest())
    return _HASHES[key]
