"""Talking to a Hugging Face hub: the repo's file list (with sizes and hashes) and a file's
bytes, over httpx, with the hub's own headers (huggingface_hub's `build_hf_headers` adds
HF_TOKEN when set).

Every call retries a 429 or 5xx answer, waiting what the hub's Retry-After asks (capped)
or a growing backoff, MAX_ATTEMPTS times in all; a connection lost while a file streams
is retried the same way, resuming from the bytes already written. Blocking: callers run
these in threads."""

import email.utils
import os
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from urllib.parse import quote

import httpx
from huggingface_hub.utils import build_hf_headers
from loguru import logger
from pydantic import BaseModel

DEFAULT_ENDPOINT = "https://huggingface.co"
# Where a node's API serves its model files to peers in the hub's shapes (api/peer_files.py).
PEER_HUB_PREFIX = "/peer-hub"
MAX_ATTEMPTS = 5
FIRST_BACKOFF_SECONDS = 0.5
MAX_WAIT_SECONDS = 20.0
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class DownloadError(Exception):
    """A model download failed; the message says why, for the user."""


class InvalidModelId(DownloadError):
    """The id is not of the form org/name."""


class ModelNotOnHub(DownloadError):
    """The hub has no such model (or none this node may read)."""


class ModelNeedsToken(DownloadError):
    """The model is gated or private and this node's HF_TOKEN (if any) may not read it."""


class HubUnreachable(DownloadError):
    """The hub did not answer."""


class HubBusy(DownloadError):
    """The hub kept answering 429 or 5xx after every retry."""


class NotArrivedYet(DownloadError):
    """A peer that will take the file from the hub has not begun it yet (api/peer_files.py)."""


# The peer hub's X-Error-Code for that.
NOT_ARRIVED_YET = "NotArrivedYet"


class _Cancelled(Exception):
    """The download was cancelled while a file streamed."""


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


class _PeerAuth(httpx.Auth):
    """A peer node's hub gets the cluster's peer token (when its API wants a key), never
    this node's HF_TOKEN."""

    def __init__(self, peer_token: str | None) -> None:
        self.peer_token = peer_token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if request.url.path.startswith(PEER_HUB_PREFIX):
            request.headers.pop("Authorization", None)
            if self.peer_token:
                request.headers["Authorization"] = f"Bearer {self.peer_token}"
        yield request


def client(peer_token: str | None = None) -> httpx.Client:
    return httpx.Client(
        headers=build_hf_headers(library_name="exo"),
        auth=_PeerAuth(peer_token),
        timeout=TIMEOUT,
        follow_redirects=True,
    )


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int | None
    # The hub's hash of the content: sha256 for LFS files, the git blob id for others.
    sha256: str | None = None
    blob_id: str | None = None


@dataclass(frozen=True)
class Call:
    """What a request is for, to word its errors."""

    endpoint: str
    model_id: str
    filename: str | None = None

    @property
    def of_file(self) -> str:
        return f" (file {self.filename})" if self.filename else ""


def retry_wait(response: httpx.Response | None, attempt: int) -> float:
    """Seconds to wait before attempt `attempt + 1`: the hub's Retry-After if it sent one
    (seconds or an HTTP date), else a doubling backoff; never more than MAX_WAIT_SECONDS."""
    backoff = FIRST_BACKOFF_SECONDS * 2 ** (attempt - 1)
    header = response.headers.get("retry-after") if response is not None else None
    if header:
        try:
            wait = float(header)
        except ValueError:
            parsed = email.utils.parsedate_to_datetime(header) if header else None
            wait = parsed.timestamp() - time.time() if parsed is not None else backoff
        backoff = max(wait, 0.0)
    return min(backoff, MAX_WAIT_SECONDS)


def status_error(response: httpx.Response, call: Call) -> DownloadError:
    status = response.status_code
    code = response.headers.get("x-error-code", "")
    if status in (401, 403) or code == "GatedRepo":
        has_token = bool(os.environ.get("HF_TOKEN"))
        advice = (
            "the HF_TOKEN set on this node may not read it (accept the model's license on the hub with that account)"
            if has_token
            else "set HF_TOKEN on this node to a token that may read it (and accept its license on the hub)"
        )
        return ModelNeedsToken(
            f"model {call.model_id} on {call.endpoint} is gated or private (HTTP {status}{call.of_file}): {advice}"
        )
    if status == 404 and (code == "RepoNotFound" or call.filename is None):
        return ModelNotOnHub(f"model {call.model_id} was not found on {call.endpoint}")
    if status == 404 and code == NOT_ARRIVED_YET:
        return NotArrivedYet(f"file {call.filename} of model {call.model_id} has not begun arriving at {call.endpoint}")
    if status == 404:
        return DownloadError(f"file {call.filename} of model {call.model_id} was not found on {call.endpoint}")
    if status in RETRIED_STATUSES:
        return HubBusy(
            f"{call.endpoint} kept answering HTTP {status} for model {call.model_id}{call.of_file} "
            f"after {MAX_ATTEMPTS} tries; try again later"
        )
    return DownloadError(f"{call.endpoint} answered HTTP {status} for model {call.model_id}{call.of_file}")


def transport_error(error: httpx.TransportError, call: Call) -> DownloadError:
    reason = str(error) or type(error).__name__
    if call.filename and not isinstance(error, httpx.ConnectError):
        return DownloadError(
            f"lost connection to {call.endpoint} while downloading {call.model_id}{call.of_file}: {reason}"
        )
    if call.filename:
        return DownloadError(f"lost connection to {call.endpoint} while downloading {call.model_id}{call.of_file}")
    return HubUnreachable(f"could not reach {call.endpoint}: {reason}")


def get(http: httpx.Client, url: str, call: Call, params: dict[str, str] | None = None) -> httpx.Response:
    """A GET with retries; returns a 2xx response or raises a DownloadError."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            response = http.get(url, params=params)
        except httpx.ConnectError as error:
            # Nobody listening: no point waiting for it (the node reports it at once).
            raise transport_error(error, call) from error
        except httpx.TransportError as error:
            if attempt == MAX_ATTEMPTS:
                raise transport_error(error, call) from error
            time.sleep(retry_wait(None, attempt))
            continue
        if response.is_success:
            return response
        if response.status_code not in RETRIED_STATUSES or attempt == MAX_ATTEMPTS:
            raise status_error(response, call)
        wait = retry_wait(response, attempt)
        logger.warning(f"{call.endpoint} answered {response.status_code}{call.of_file}; retrying in {wait:.1f} s")
        time.sleep(wait)
    raise AssertionError("unreachable")


def list_repo(http: httpx.Client, call: Call, revision: str = "main") -> tuple[str, list[RepoFile]]:
    """(commit, files) of a model repo, as `HfApi.model_info(files_metadata=True)` reads them."""
    url = f"{call.endpoint}/api/models/{call.model_id}/revision/{quote(revision, safe='')}"
    info = get(http, url, call, params={"blobs": "true"}).json()
    files = []
    for sibling in info.get("siblings") or []:
        lfs = sibling.get("lfs") or {}
        files.append(RepoFile(sibling["rfilename"], sibling.get("size"), lfs.get("sha256"), sibling.get("blobId")))
    return info.get("sha") or revision, files


def file_url(endpoint: str, model_id: str, revision: str, filename: str) -> str:
    return f"{endpoint}/{model_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"


def get_file_bytes(http: httpx.Client, call: Call, revision: str) -> bytes:
    """A small file's content (config, index), with retries."""
    assert call.filename is not None
    return get(http, file_url(call.endpoint, call.model_id, revision, call.filename), call).content


def stream_file(
    http: httpx.Client,
    call: Call,
    revision: str,
    write: Callable[[bytes], None],
    offset: Callable[[], int],
    restart: Callable[[], None],
    cancel: threading.Event,
) -> None:
    """Streams a file's bytes into `write`, from `offset()` on with a Range request;
    retried like `get`, each retry resuming from where the last one stopped. A hub that
    ignores Range (200) makes it `restart()` from zero."""
    assert call.filename is not None
    url = file_url(call.endpoint, call.model_id, revision, call.filename)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        start = offset()
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            with http.stream("GET", url, headers=headers) as response:
                if response.status_code == 416:
                    return  # nothing left to send: the bytes we hold are the whole file
                if not response.is_success:
                    if response.status_code not in RETRIED_STATUSES or attempt == MAX_ATTEMPTS:
                        raise status_error(response, call)
                    time.sleep(retry_wait(response, attempt))
                    continue
                if start and response.status_code != 206:
                    restart()
                for chunk in response.iter_bytes():
                    if cancel.is_set():
                        raise _Cancelled()
                    write(chunk)
                return
        except httpx.ConnectError as error:
            # The hub went away: a couple of tries, not the full backoff.
            if attempt >= 3:
                raise transport_error(error, call) from error
            time.sleep(retry_wait(None, attempt))
        except httpx.TransportError as error:
            if attempt == MAX_ATTEMPTS:
                raise transport_error(error, call) from error
            time.sleep(retry_wait(None, attempt))


class HubModel(BaseModel):
    """One model of a hub search."""

    id: str
    author: str
    downloads: int
    likes: int
    last_modified: str
    tags: list[str]


def search_models(query: str, limit: int, endpoint: str | None = None) -> list[HubModel]:
    """The hub's model search (`GET /api/models?search=`), most downloaded first. Blocking;
    raises HubUnreachable or HubBusy (or DownloadError) with a message for the user."""
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    call = Call(endpoint, f"search {query!r}")
    params = {"search": query, "limit": str(limit), "sort": "downloads", "direction": "-1"}
    with client() as http:
        found = get(http, f"{endpoint}/api/models", call, params=params).json()
    if not isinstance(found, list):
        raise DownloadError(f"{endpoint} answered the model search with something other than a list")
    return [
        HubModel(
            id=str(entry.get("id") or entry.get("modelId") or ""),
            author=str(entry.get("author") or ""),
            downloads=int(entry.get("downloads") or 0),
            likes=int(entry.get("likes") or 0),
            last_modified=str(entry.get("lastModified") or ""),
            tags=[str(tag) for tag in entry.get("tags") or []],
        )
        for entry in found
        if isinstance(entry, dict)
    ]
