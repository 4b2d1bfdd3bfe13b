"""Downloading a model's files from a Hugging Face hub into a models dir.

`download_model` lists the repo's files (with sizes) through `HfApi.model_info`, keeps the
ones needed to run the model (config, safetensors weights, tokenizer, chat template and
generation config; no `*.py`, no pickles, nothing in subfolders) and fetches them one by one
with `hf_hub_download(local_dir=...)`. huggingface_hub does all the HTTP.

Files land in `<target_dir>/.downloads/<org>--<name>.partial/`, which no models-dir scan
looks at. Only when every file is there and the dir passes `is_complete_model_dir` is it
renamed to `<target_dir>/<org>--<name>`, so an interrupted download never looks like a
complete model. Files finished by an interrupted attempt stay in the partial dir and are
not fetched again by the next attempt (file-level resume).

Progress: bytes of finished files plus the size of the partial (`*.incomplete`) files
huggingface_hub is writing, polled every `POLL_SECONDS` while a file downloads;
huggingface_hub writes in chunks of up to 10 MB, so progress inside a file moves in such
steps.
"""

import asyncio
import contextlib
import errno
import inspect
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from exo.catalog.cards import card_from_config
from exo.catalog.model_dirs import is_complete_model_dir, model_dir_name
from exo.shared.models.model_cards import ModelCard

DEFAULT_ENDPOINT = "https://huggingface.co"
POLL_SECONDS = 0.5
# Window over which bytes_per_second is measured.
RATE_WINDOW_SECONDS = 5.0
# Free space to keep on the disk on top of the model's own size.
DISK_SPACE_MARGIN_BYTES = 64 * 1024 * 1024
LIST_TIMEOUT_SECONDS = 30.0
PARTIAL_DIR_NAME = ".downloads"
INDEX_FILE = "model.safetensors.index.json"

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
T = TypeVar("T")


class DownloadError(Exception):
    """A model download failed; the message says why, for the user."""


class InvalidModelId(DownloadError):
    """The id is not of the form org/name."""


class ModelNotOnHub(DownloadError):
    """The hub has no such model (or none this node may read)."""


class HubUnreachable(DownloadError):
    """The hub did not answer."""


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int | None


def wanted_file(name: str) -> bool:
    return "/" not in name and any(fnmatch(name, pattern) for pattern in WANTED_FILE_PATTERNS)


_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _check_model_id(model_id: str) -> None:
    if not _MODEL_ID.fullmatch(model_id) or ".." in model_id or "--" in model_id:
        raise InvalidModelId(f"{model_id!r} is not a hub model id of the form org/name")


# ---------------------------------------------------------------------------------------
# Errors from huggingface_hub / the HTTP client, as DownloadErrors with clear messages.


def _network_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, names in (
        ("httpx2", ("TransportError",)),  # huggingface_hub >= 2
        ("httpx", ("TransportError",)),  # huggingface_hub 1.x
        ("requests.exceptions", ("ConnectionError", "Timeout", "ChunkedEncodingError")),  # 0.x
    ):
        try:
            module = __import__(module_name, fromlist=list(names))
        except ImportError:
            continue
        types.extend(getattr(module, name) for name in names if hasattr(module, name))
    return tuple(types)


_NETWORK_ERRORS = _network_error_types()


def _hf_error(name: str) -> type[BaseException]:
    from huggingface_hub import errors

    # Names missing from an older huggingface_hub map to a class nothing raises.
    return getattr(errors, name, type(f"_Missing{name}", (Exception,), {}))


def _root_network_error(error: BaseException) -> BaseException | None:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _NETWORK_ERRORS):
            return current
        current = current.__cause__ or current.__context__
    return None


def _describe(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


def _as_download_error(
    error: BaseException, *, model_id: str, endpoint: str, filename: str | None, local_dir: Path
) -> DownloadError:
    of_file = f" (file {filename})" if filename else ""
    if isinstance(error, DownloadError):
        return error
    if isinstance(error, _hf_error("OfflineModeIsEnabled")):
        return DownloadError(f"cannot download model {model_id}: huggingface_hub offline mode is on (HF_HUB_OFFLINE)")
    if isinstance(error, _hf_error("GatedRepoError")):
        return ModelNotOnHub(
            f"model {model_id} on {endpoint} is gated: accept its license on the hub and set HF_TOKEN on this node"
        )
    if isinstance(error, _hf_error("RepositoryNotFoundError")):
        return ModelNotOnHub(f"model {model_id} was not found on {endpoint}")
    if isinstance(error, _hf_error("RevisionNotFoundError")):
        return DownloadError(f"model {model_id} has no such revision on {endpoint}")
    if isinstance(error, _hf_error("LocalEntryNotFoundError")):
        # Raised by hf_hub_download when the metadata request failed (connection, hub down).
        cause = error.__cause__ or error.__context__
        network = _root_network_error(error)
        reason = _describe(network or cause or error)
        return HubUnreachable(f"could not reach {endpoint}: {reason}{of_file}")
    if isinstance(error, _hf_error("RemoteEntryNotFoundError")) or isinstance(error, _hf_error("EntryNotFoundError")):
        return DownloadError(f"file {filename} of model {model_id} was not found on {endpoint}")
    if isinstance(error, _hf_error("FileMetadataError")):
        return DownloadError(f"{endpoint} does not behave like a Hugging Face hub{of_file}: {_describe(error)}")
    if isinstance(error, _hf_error("HfHubHTTPError")):
        response = getattr(error, "response", None)
        status = getattr(response, "status_code", "?")
        return DownloadError(f"{endpoint} answered HTTP {status} for model {model_id}{of_file}: {_describe(error)}")
    network = _root_network_error(error)
    if network is not None:
        if filename:
            return DownloadError(
                f"lost connection to {endpoint} while downloading {model_id}{of_file}: {_describe(network)}"
            )
        return HubUnreachable(f"could not reach {endpoint}: {_describe(network)}")
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return DownloadError(f"disk full while downloading model {model_id} into {local_dir}{of_file}")
    if isinstance(error, OSError):
        return DownloadError(f"downloading model {model_id} into {local_dir} failed{of_file}: {_describe(error)}")
    return DownloadError(f"downloading model {model_id} from {endpoint} failed{of_file}: {_describe(error)}")


# ---------------------------------------------------------------------------------------
# Blocking huggingface_hub calls (run in threads).


def _check_routing(model_id: str, endpoint: str) -> None:
    """huggingface_hub builds file URLs from a template fixed at import (from HF_ENDPOINT) and
    swaps in an explicit endpoint only if the template still starts with its own ENDPOINT;
    make sure file requests really go to `endpoint` and nowhere else."""
    from huggingface_hub import hf_hub_url

    url = hf_hub_url(model_id, "config.json", revision="main", endpoint=endpoint)
    if not url.startswith(endpoint + "/"):
        raise DownloadError(f"huggingface_hub would fetch {model_id} from {url} instead of {endpoint}")


def _list_repo(model_id: str, endpoint: str) -> tuple[str, list[RepoFile]]:
    from huggingface_hub import HfApi

    _check_routing(model_id, endpoint)
    info = HfApi(endpoint=endpoint).model_info(model_id, files_metadata=True, timeout=LIST_TIMEOUT_SECONDS)
    files = [RepoFile(sibling.rfilename, sibling.size) for sibling in info.siblings or []]
    return info.sha or "main", files


class _Cancelled(Exception):
    """Raised inside huggingface_hub's download loop once the download was cancelled."""


def _cancellable_bar(cancel: threading.Event) -> type:
    """A silent progress bar class that aborts huggingface_hub's download loop on cancel."""
    from tqdm import tqdm

    class CancellableBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel.is_set():
                raise _Cancelled()
            return super().update(n)

    return CancellableBar


def _hf_download_accepts_tqdm_class() -> bool:
    from huggingface_hub import hf_hub_download

    return "tqdm_class" in inspect.signature(hf_hub_download).parameters


def _fetch_file(
    model_id: str, filename: str, revision: str, local_dir: Path, endpoint: str, cancel: threading.Event
) -> Path:
    from huggingface_hub import hf_hub_download

    if cancel.is_set():
        raise _Cancelled()
    extra: dict[str, Any] = {}
    if _hf_download_accepts_tqdm_class():
        extra["tqdm_class"] = _cancellable_bar(cancel)
    path = hf_hub_download(model_id, filename, revision=revision, local_dir=local_dir, endpoint=endpoint, **extra)
    return Path(path)


# ---------------------------------------------------------------------------------------
# Progress.


class _Progress:
    def __init__(self, on_progress: ProgressCallback, total: int, partial_dir: Path) -> None:
        self._on_progress = on_progress
        self.total = total
        self._partial_dir = partial_dir
        self.finished_bytes = 0
        self._reported = -1
        self._samples: deque[tuple[float, int]] = deque()

    def _in_flight_bytes(self) -> int:
        download_dir = self._partial_dir / ".cache" / "huggingface" / "download"
        size = 0
        for path in download_dir.rglob("*.incomplete") if download_dir.is_dir() else ():
            with contextlib.suppress(OSError):
                size += path.stat().st_size
        return size

    def _rate(self, now: float, downloaded: int) -> float:
        self._samples.append((now, downloaded))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_SECONDS:
            self._samples.popleft()
        start_time, start_bytes = self._samples[0]
        elapsed = now - start_time
        return (downloaded - start_bytes) / elapsed if elapsed > 0 else 0.0

    def report(self, in_flight: bool = False) -> None:
        downloaded = self.finished_bytes + (self._in_flight_bytes() if in_flight else 0)
        # A restarted file can shrink its partial file; what was reported stays reported.
        downloaded = min(max(downloaded, self._reported), self.total)
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
                self.report(in_flight=True)
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


def _select_weights(files: list[RepoFile], partial_dir: Path, model_id: str) -> list[RepoFile]:
    """With an index, only the shards it names (repos sometimes also carry a consolidated copy)."""
    index_path = partial_dir / INDEX_FILE
    if not index_path.is_file():
        return files
    try:
        shards = set(json.loads(index_path.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DownloadError(f"model {model_id} has an unreadable {INDEX_FILE}: {error}") from error
    names = {file.name for file in files}
    missing = sorted(shard for shard in shards if shard not in names)
    if missing:
        raise DownloadError(f"model {model_id}'s {INDEX_FILE} names weight files the repo lacks: {', '.join(missing)}")
    return [file for file in files if not file.name.endswith(".safetensors") or file.name in shards]


def _present_names(files: list[RepoFile], partial_dir: Path) -> set[str]:
    """Files a previous attempt already finished (hf_hub_download will not fetch them again)."""
    present = set()
    for file in files:
        path = partial_dir / file.name
        if file.size is not None and path.is_file() and path.stat().st_size == file.size:
            present.add(file.name)
    return present


def _check_disk_space(partial_dir: Path, needed: int, model_id: str) -> None:
    free = shutil.disk_usage(partial_dir).free
    if free < needed + DISK_SPACE_MARGIN_BYTES:
        raise DownloadError(
            f"not enough disk space for model {model_id} in {partial_dir.parent.parent}: "
            f"needs {needed / 1e9:.2f} GB more, {free / 1e9:.2f} GB free"
        )


def _finish(partial_dir: Path, final_dir: Path, files: list[RepoFile], model_id: str, endpoint: str) -> None:
    for file in files:
        path = partial_dir / file.name
        if not path.is_file() or (file.size is not None and path.stat().st_size != file.size):
            raise DownloadError(f"file {file.name} of model {model_id} did not download completely")
    shutil.rmtree(partial_dir / ".cache", ignore_errors=True)
    # Leftovers of an earlier attempt at another revision of the repo.
    expected = {file.name for file in files}
    for path in partial_dir.iterdir():
        if path.name not in expected:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
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
    filename: str | None = None
    with tempfile.TemporaryDirectory(prefix="exo-card-") as scratch:
        try:
            revision, listed = _list_repo(model_id, endpoint)
            names = {file.name for file in listed}
            if "config.json" not in names:
                raise DownloadError(f"model {model_id} on {endpoint} has no config.json, so exo cannot run it")
            for filename in ("config.json", INDEX_FILE):
                if filename in names:
                    _fetch_file(model_id, filename, revision, Path(scratch), endpoint, threading.Event())
            filename = None
            weights = _select_weights([f for f in listed if wanted_file(f.name)], Path(scratch), model_id)
            config = json.loads((Path(scratch) / "config.json").read_text())
            weight_bytes = sum(file.size or 0 for file in weights if file.name.endswith(".safetensors"))
            return card_from_config(config, model_id, weight_bytes)
        except DownloadError:
            raise
        except ValueError as error:  # a config.json that is not JSON, or not a language model's
            raise DownloadError(f"model {model_id}'s config.json cannot be read as a model: {error}") from error
        except Exception as error:
            raise _as_download_error(
                error, model_id=model_id, endpoint=endpoint, filename=filename, local_dir=Path(scratch)
            ) from error


async def download_model(
    model_id: str,
    target_dir: Path,
    on_progress: ProgressCallback,
    endpoint: str | None = None,
) -> Path:
    """Downloads `model_id` ("org/name") into `target_dir/org--name` and returns that dir.

    Calls on_progress(downloaded_bytes, total_bytes, bytes_per_second) at the start, every
    POLL_SECONDS while a file downloads, after each file and at the end (downloaded ==
    total). Raises DownloadError with a message for the user on any failure. Cancelling
    the coroutine stops the download; finished files are kept for the next attempt.
    """
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    _check_model_id(model_id)
    target_dir = Path(target_dir)
    final_dir = target_dir / model_dir_name(model_id)
    partial_dir = target_dir / PARTIAL_DIR_NAME / f"{model_dir_name(model_id)}.partial"
    cancel = threading.Event()
    filename: str | None = None

    async def in_thread(function: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(function, *args)

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
            revision, listed = await in_thread(_list_repo, model_id, endpoint)
            files = [file for file in listed if wanted_file(file.name)]
            if not files:
                raise DownloadError(f"model {model_id} on {endpoint} has no files exo can run")
            partial_dir.mkdir(parents=True, exist_ok=True)

            if any(file.name == INDEX_FILE for file in files):
                filename = INDEX_FILE
                await in_thread(_fetch_file, model_id, INDEX_FILE, revision, partial_dir, endpoint, cancel)
                files = _select_weights(files, partial_dir, model_id)
            # Small files first, so a missing tokenizer or config fails before the weights.
            files.sort(key=lambda file: (file.name.endswith(".safetensors"), file.size or 0, file.name))

            total = sum(file.size or 0 for file in files)
            counted = _present_names(files, partial_dir)
            present = sum(file.size or 0 for file in files if file.name in counted)
            _check_disk_space(partial_dir, total - present, model_id)
            progress = _Progress(on_progress, total, partial_dir)
            progress.finished_bytes = present
            progress.report()
            logger.info(f"downloading {model_id} from {endpoint}: {len(files)} files, {total / 1e9:.2f} GB")

            for file in files:
                filename = file.name
                path = await progress.watch(
                    in_thread(_fetch_file, model_id, file.name, revision, partial_dir, endpoint, cancel)
                )
                if file.name not in counted:
                    counted.add(file.name)
                    if file.size is None:  # a hub that did not list the size
                        progress.total += path.stat().st_size
                    progress.finished_bytes += file.size if file.size is not None else path.stat().st_size
                progress.report()
            filename = None

            await in_thread(_finish, partial_dir, final_dir, files, model_id, endpoint)
            progress.finished_bytes = progress.total
            progress.report()
            logger.info(f"downloaded {model_id} to {final_dir}")
            return final_dir
        except (DownloadError, asyncio.CancelledError):
            raise
        except Exception as error:
            raise _as_download_error(
                error, model_id=model_id, endpoint=endpoint, filename=filename, local_dir=target_dir
            ) from error
        finally:
            # Stops a file download still running in its thread (after a cancel).
            cancel.set()
