"""Downloading a model's files from a Hugging Face hub into a models dir.

`download_model` lists the repo's files (sizes and hashes) and keeps the ones needed to
run the model (config, safetensors weights, tokenizer, chat template and generation
config; no `*.py`, no pickles, nothing in subfolders). Given a layer range it keeps only
the weight files those layers need (shared/models/weight_files.py). Each file is fetched and verified by
verify.py, the HTTP and its retries are hub.py's.

Files land in `<target_dir>/.downloads/<org>--<name>.partial/`, which no models-dir scan
looks at. When the dir holds every file of the model and passes `is_complete_model_dir`
it is renamed to `<target_dir>/<org>--<name>`, so an interrupted download never looks like
a complete model. A download of some layers only returns the partial dir itself, which
holds verified files only; a later download of other layers adds theirs to it.

Progress: bytes verified or streaming, reported every POLL_SECONDS while a file downloads.
"""

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import TypeVar

import httpx
from loguru import logger

from exo.catalog.cards import card_from_config
from exo.catalog.model_dirs import is_complete_model_dir, model_dir_name, partial_model_dir
from exo.shared.models.model_cards import ModelCard
from exo.shared.models.weight_files import INDEX_FILE, config_layer_count, files_for_layers
from exo.worker.download.hub import (
    Call,
    DownloadError,
    HubBusy,
    HubUnreachable,
    InvalidModelId,
    NotArrivedYet,
    RepoFile,
    client,
    get_file_bytes,
    hub_endpoint,
)
from exo.worker.download.hub import list_repo as hub_list_repo
from exo.worker.download.verify import PARTIAL_SUFFIX, fetch_verified

POLL_SECONDS = 0.5
# Window over which bytes_per_second is measured.
RATE_WINDOW_SECONDS = 5.0
# Free space to keep on the disk on top of the model's own size.
DISK_SPACE_MARGIN_BYTES = 64 * 1024 * 1024

# Top-level repo files a node needs to run a model.
WANTED_FILE_PATTERNS = (
    "*.safetensors",
    "*.json",  # config, generation config, tokenizer, index, chat_template.json, preprocessor
    "*.jinja",  # chat_template.jinja
    "*.model",  # sentencepiece tokenizers (tokenizer.model)
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
)

ProgressCallback = Callable[[int, int, float], None]
# (file name, the model's weight map if known) -> the peer hubs to take the file from, as
# State says when its turn comes: nodes holding it, then the one taking it from the hub.
PeerSources = Callable[[str, dict[str, str] | None], list[str]]
T = TypeVar("T")


def wanted_file(name: str) -> bool:
    return "/" not in name and any(fnmatch(name, pattern) for pattern in WANTED_FILE_PATTERNS)


_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _check_model_id(model_id: str) -> None:
    if not _MODEL_ID.fullmatch(model_id) or ".." in model_id or "--" in model_id:
        raise InvalidModelId(f"{model_id!r} is not a hub model id of the form org/name")


def _check_online(model_id: str) -> None:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise DownloadError(f"cannot download model {model_id}: huggingface_hub offline mode is on (HF_HUB_OFFLINE)")


def _os_error(error: OSError, model_id: str, local_dir: Path, filename: str | None) -> DownloadError:
    of_file = f" (file {filename})" if filename else ""
    if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return DownloadError(f"disk full while downloading model {model_id} into {local_dir}{of_file}")
    return DownloadError(f"downloading model {model_id} into {local_dir} failed{of_file}: {error}")


# ---------------------------------------------------------------------------------------
# Progress.


class _Progress:
    def __init__(self, on_progress: ProgressCallback, total: int) -> None:
        self._on_progress = on_progress
        self.total = total
        # Bytes verified or streaming; download threads add to it as bytes arrive.
        self.downloaded = 0
        self._reported = -1
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        self.downloaded += n

    def _rate(self, now: float, downloaded: int) -> float:
        self._samples.append((now, downloaded))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_SECONDS:
            self._samples.popleft()
        start_time, start_bytes = self._samples[0]
        elapsed = now - start_time
        return (downloaded - start_bytes) / elapsed if elapsed > 0 else 0.0

    def report(self) -> None:
        # A file downloaded again after a failed check drops its bytes; what was reported stays.
        downloaded = min(max(self.downloaded, self._reported), self.total)
        rate = self._rate(time.monotonic(), downloaded)
        self._reported = downloaded
        self._on_progress(downloaded, self.total, rate)

    async def watch(self, work: Awaitable[T]) -> T:
        """Awaits `work`, reporting progress every POLL_SECONDS meanwhile."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
                if done:
                    return task.result()
                self.report()
        finally:
            if not task.done():
                task.cancel()


# ---------------------------------------------------------------------------------------
# The download.

_ACTIVE: set[Path] = set()


@contextlib.asynccontextmanager
async def _exclusive(path: Path) -> AsyncIterator[None]:
    """One download per model dir at a time in this process; a second caller waits."""
    while path in _ACTIVE:
        await asyncio.sleep(POLL_SECONDS)
    _ACTIVE.add(path)
    try:
        yield
    finally:
        _ACTIVE.discard(path)


def _dir_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _weight_map(index_bytes: bytes, model_id: str) -> dict[str, str]:
    try:
        weight_map = json.loads(index_bytes)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        return {str(tensor): str(file) for tensor, file in weight_map.items()}
    except (ValueError, KeyError, TypeError) as error:
        raise DownloadError(f"model {model_id} has an unreadable {INDEX_FILE}: {error}") from error


def _layer_count(config_bytes: bytes) -> int | None:
    try:
        return config_layer_count(json.loads(config_bytes))
    except ValueError:
        return None  # the runner says what is wrong with it


def _select_weights(
    files: list[RepoFile],
    weight_map: dict[str, str] | None,
    layers: tuple[int, int] | None,
    model_id: str,
    n_layers: int | None = None,
) -> list[RepoFile]:
    """With an index, only the shards it names (repos sometimes also carry a consolidated
    copy), and of those only the ones `layers` of a model of `n_layers` need (an empty
    range: none)."""
    if layers is not None and layers[0] == layers[1]:
        return [file for file in files if not file.name.endswith(".safetensors")]
    if weight_map is None:
        return files
    names = {file.name for file in files}
    missing = sorted(shard for shard in set(weight_map.values()) if shard not in names)
    if missing:
        raise DownloadError(f"model {model_id}'s {INDEX_FILE} names weight files the repo lacks: {', '.join(missing)}")
    needed = files_for_layers(weight_map, layers, n_layers)
    return [file for file in files if not file.name.endswith(".safetensors") or file.name in needed]


def _held(files: list[RepoFile], partial_dir: Path) -> set[str]:
    """Files an earlier attempt verified (a file under its own name was); one of the wrong
    size is from another revision of the repo and goes."""
    held = set()
    for file in files:
        path = partial_dir / file.name
        if not path.is_file():
            continue
        if file.size is None or path.stat().st_size == file.size:
            held.add(file.name)
        else:
            path.unlink()
    return held


def _check_disk_space(partial_dir: Path, needed: int, model_id: str) -> None:
    free = shutil.disk_usage(partial_dir).free
    if free < needed + DISK_SPACE_MARGIN_BYTES:
        raise DownloadError(
            f"not enough disk space for model {model_id} in {partial_dir.parent.parent}: "
            f"needs {needed / 1e9:.2f} GB more, {free / 1e9:.2f} GB free"
        )


def _drop_leftovers(partial_dir: Path, listed: list[RepoFile]) -> None:
    """Files of an earlier attempt at another revision of the repo."""
    expected = {file.name for file in listed} | {file.name + PARTIAL_SUFFIX for file in listed}
    for path in partial_dir.iterdir():
        if path.name not in expected:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _finish(partial_dir: Path, final_dir: Path, model_id: str, endpoint: str) -> None:
    if not is_complete_model_dir(partial_dir):
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise DownloadError(
            f"model {model_id} on {endpoint} lacks files exo needs to run it "
            "(config.json, safetensors weights and a tokenizer)"
        )
    try:
        os.rename(partial_dir, final_dir)
    except OSError as error:
        if is_complete_model_dir(final_dir):  # another process finished first
            shutil.rmtree(partial_dir, ignore_errors=True)
            return
        raise DownloadError(f"could not move the downloaded model {model_id} to {final_dir}: {error}") from error
    with contextlib.suppress(OSError):
        partial_dir.parent.rmdir()  # only if no other download is in progress


def fetch_card(model_id: str, endpoint: str | None = None) -> ModelCard:
    """A card for a hub model, read from its config.json and the weight sizes the hub
    lists, without downloading the weights. Blocking; raises DownloadError (or one of its
    kinds) with a message for the user."""
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    _check_model_id(model_id)
    _check_online(model_id)
    with client() as http:
        revision, listed = hub_list_repo(http, Call(endpoint, model_id))
        names = {file.name for file in listed}
        if "config.json" not in names:
            raise DownloadError(f"model {model_id} on {endpoint} has no config.json, so exo cannot run it")
        config_bytes = get_file_bytes(http, Call(endpoint, model_id, "config.json"), revision)
        weight_map = None
        if INDEX_FILE in names:
            weight_map = _weight_map(get_file_bytes(http, Call(endpoint, model_id, INDEX_FILE), revision), model_id)
    weights = _select_weights([f for f in listed if wanted_file(f.name)], weight_map, None, model_id)
    weight_bytes = sum(file.size or 0 for file in weights if file.name.endswith(".safetensors"))
    try:
        return card_from_config(json.loads(config_bytes), model_id, weight_bytes)
    except ValueError as error:  # a config.json that is not JSON, or not a language model's
        raise DownloadError(f"model {model_id}'s config.json cannot be read as a model: {error}") from error


async def download_model(
    model_id: str,
    target_dir: Path,
    on_progress: ProgressCallback,
    endpoint: str | None = None,
    layers: tuple[int, int] | None = None,
    peers: Mapping[str, frozenset[str]] | None = None,
    peer_token: str | None = None,
    peer_sources: PeerSources | None = None,
) -> Path:
    """Downloads `model_id` ("org/name") into `target_dir/org--name` and returns that dir;
    with `layers` [start, end), only the weight files those layers need, and returns the
    partial dir holding them unless that makes the model whole. `peers`: endpoints of
    other nodes' peer hubs (api/peer_files.py), each with the files it holds; a file is
    taken from a peer holding it before the hub, and checked against the hub's hashes
    (the peers' own listing when the hub does not answer); `peer_token` is what the
    peers' APIs want when they need a key. `peer_sources(file, weight_map)`: asked when a
    file's turn comes, the peer hubs of the nodes holding it now, then that of the node
    taking it from the hub for every node needing it, if that is not this one; the file
    is streamed from that node as it arrives there, and this node waits for it to start
    arriving as long as State names that node. Files no peer will give come first.

    Calls on_progress(downloaded_bytes, total_bytes, bytes_per_second) at the start, every
    POLL_SECONDS while a file downloads, after each file and at the end (downloaded ==
    total). Raises DownloadError with a message for the user on any failure. Cancelling
    the coroutine stops the download; verified files and the partial one are kept for the
    next attempt.
    """
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    _check_model_id(model_id)
    target_dir = Path(target_dir)
    final_dir = target_dir / model_dir_name(model_id)
    partial_dir = partial_model_dir(target_dir, model_id)
    cancel = threading.Event()

    async with _exclusive(final_dir):
        try:
            if is_complete_model_dir(final_dir):
                size = _dir_bytes(final_dir)
                on_progress(size, size, 0.0)
                return final_dir
            if final_dir.exists():
                raise DownloadError(
                    f"{final_dir} exists but is not a complete model dir; remove it to download {model_id} again"
                )
            _check_online(model_id)
            with client(peer_token) as http:
                sources = _Sources(http, model_id, endpoint, dict(peers or {}), peer_sources)
                return await _download(sources, partial_dir, final_dir, on_progress, layers, cancel)
        except OSError as error:
            raise _os_error(error, model_id, target_dir, None) from error
        finally:
            # Stops a file download still running in its thread (after a cancel).
            cancel.set()


class _Sources:
    """Where a model's files come from: peers that hold them, then the hub."""

    def __init__(
        self,
        http: httpx.Client,
        model_id: str,
        endpoint: str,
        peers: dict[str, frozenset[str]],
        peer_sources: PeerSources | None = None,
    ) -> None:
        self.http, self.model_id, self.endpoint, self.peers = http, model_id, endpoint, peers
        self.peer_sources = peer_sources
        # The model's safetensors index once read: which node needs which weight file.
        self.weight_map: dict[str, str] | None = None

    def list_repo(self, partial_dir: Path) -> tuple[str, list[RepoFile]]:
        """The hub's listing; if the hub does not answer, what the peers hold, and the
        verified files already in `partial_dir`."""
        try:
            return hub_list_repo(self.http, Call(self.endpoint, self.model_id))
        except (HubUnreachable, HubBusy) as error:
            merged: dict[str, RepoFile] = {}
            if partial_dir.is_dir():
                for path in partial_dir.iterdir():
                    if path.is_file() and not path.name.endswith(PARTIAL_SUFFIX):
                        merged[path.name] = RepoFile(path.name, path.stat().st_size)
            answered = 0
            for peer in self.peers:
                with contextlib.suppress(DownloadError):
                    merged |= {file.name: file for file in hub_list_repo(self.http, Call(peer, self.model_id))[1]}
                    answered += 1
            if not answered:
                raise
            logger.warning(f"{error}; listing {self.model_id} from {answered} peers instead")
            return "main", list(merged.values())

    def peers_for(self, name: str) -> list[str]:
        """Peers to take the file from: those that held it when the download started (the
        only ones listed if State cannot be asked), then whom State names now."""
        holders = [peer for peer, files in self.peers.items() if name in files]
        named = self.peer_sources(name, self.weight_map) if self.peer_sources is not None else []
        return list(dict.fromkeys([*holders, *named]))

    def fetch(
        self, revision: str, file: RepoFile, directory: Path, cancel: threading.Event, on_bytes: Callable[[int], None]
    ) -> Path:
        # Asked again whenever the node taking the file from the hub has not begun it: it
        # will (it fetches the files it takes for others before any it follows), unless
        # State stops naming it (it failed, left, or another node holds the file now).
        while not cancel.is_set():
            for source in [*self.peers_for(file.name), self.endpoint]:
                try:
                    path = fetch_verified(
                        self.http, Call(source, self.model_id, file.name), revision, file, directory, cancel, on_bytes
                    )
                except NotArrivedYet:
                    logger.info(f"{file.name} of {self.model_id} has not begun arriving at peer {source}; waiting")
                    break
                except DownloadError as error:
                    if source == self.endpoint:
                        raise
                    logger.warning(f"peer {source} could not give {file.name}: {error}; trying the next source")
                    continue
                if source != self.endpoint:
                    logger.info(f"took {file.name} of {self.model_id} from peer {source}")
                return path
        raise DownloadError(f"the download of {file.name} of {self.model_id} was cancelled")


async def _download(
    sources: _Sources,
    partial_dir: Path,
    final_dir: Path,
    on_progress: ProgressCallback,
    layers: tuple[int, int] | None,
    cancel: threading.Event,
) -> Path:
    model_id, endpoint = sources.model_id, sources.endpoint
    revision, listed = await asyncio.to_thread(sources.list_repo, partial_dir)
    listed = [file for file in listed if wanted_file(file.name)]
    if not listed:
        raise DownloadError(f"model {model_id} on {endpoint} has no files exo can run")
    partial_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(_drop_leftovers, partial_dir, listed)

    def fetch(file: RepoFile, on_bytes: Callable[[int], None]) -> Awaitable[Path]:
        return asyncio.to_thread(sources.fetch, revision, file, partial_dir, cancel, on_bytes)

    weight_map = None
    index = next((file for file in listed if file.name == INDEX_FILE), None)
    if index is not None:
        if not (partial_dir / INDEX_FILE).is_file():
            await fetch(index, lambda n: None)
        weight_map = _weight_map((partial_dir / INDEX_FILE).read_bytes(), model_id)
        sources.weight_map = weight_map
    n_layers = None
    config = next((file for file in listed if file.name == "config.json"), None)
    if weight_map is not None and layers is not None and config is not None:
        # Which rank is the last one (it reads the final norm and the head) is the config's.
        if not (partial_dir / config.name).is_file():
            await fetch(config, lambda n: None)
        n_layers = _layer_count((partial_dir / config.name).read_bytes())
    files = _select_weights(listed, weight_map, layers, model_id, n_layers)
    # Small files first, so a missing tokenizer or config fails before the weights; and the
    # files this node takes from the hub before those it follows another node for, so no
    # node waits for one that is itself waiting.
    follows = {file.name for file in files if sources.peers_for(file.name)}
    files.sort(key=lambda file: (file.name.endswith(".safetensors"), file.name in follows, file.size or 0, file.name))

    total = sum(file.size or 0 for file in files)
    held = _held(files, partial_dir)
    progress = _Progress(on_progress, total)
    progress.downloaded = sum(file.size or 0 for file in files if file.name in held)
    _check_disk_space(partial_dir, total - progress.downloaded, model_id)
    progress.report()
    logger.info(f"downloading {model_id} from {endpoint}: {len(files)} files, {total / 1e9:.2f} GB")

    for file in files:
        if file.name in held:
            continue
        path = await progress.watch(fetch(file, progress.add))
        if file.size is None:  # a hub that did not list the size
            progress.total += path.stat().st_size
        progress.report()

    progress.downloaded = progress.total
    whole = weight_map is None or all((partial_dir / name).is_file() for name in set(weight_map.values()))
    if not whole:
        progress.report()
        logger.info(f"downloaded layers {layers} of {model_id} to {partial_dir}")
        return partial_dir
    await asyncio.to_thread(_finish, partial_dir, final_dir, model_id, endpoint)
    progress.report()
    logger.info(f"downloaded {model_id} to {final_dir}")
    return final_dir
