"""Images in a request: every adapter hands them on as Chat Completions `image_url` parts
(a data URL, or an http(s) URL this node fetches). Here each becomes bytes checked to be an
image within the limits, named by its sha256: the part turns into {"type": "image",
"sha256": ...} and the task's `images` lists each image once, however often the messages
show it. The bytes go into this node's image store (shared/image_store.py) and the task
names this node as their holder: the worker that runs the task takes them from here
once (without a store, in-process tests, they ride in the task). Anything else (audio, files), images for a model without vision,
and images that are broken, too large, too many or unreachable are a 400."""

import asyncio
import base64
import binascii
import hashlib
import io
import os
import warnings
from pathlib import Path

import httpx
from PIL import Image

from exo.api.errors import ApiError
from exo.shared.image_store import put_image
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import NodeId
from exo.shared.types.text_generation import ChatMessage, ImageInput, TextGenerationTaskParams

# Content parts that carry media rather than text, as the adapters pass them on.
MEDIA_PARTS = {"image_url", "image", "input_image", "input_audio", "audio", "file", "input_file"}
IMAGE_PARTS = {"image_url", "image", "input_image"}


def max_images() -> int:
    return int(os.environ.get("EXO_MAX_IMAGES", "16"))


def max_image_bytes() -> int:
    return int(os.environ.get("EXO_MAX_IMAGE_BYTES", str(20 * 2**20)))


def max_image_pixels() -> int:
    return int(os.environ.get("EXO_MAX_IMAGE_PIXELS", str(50_000_000)))


def image_fetch_seconds() -> float:
    return float(os.environ.get("EXO_IMAGE_FETCH_SECONDS", "10"))


def _bad_image(message: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, message, code=code, param="messages")


def _part_url(part: dict) -> str:
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else ""


def _from_data_url(url: str, number: int) -> bytes:
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise _bad_image(f"image {number}: a data URL must be base64 ('data:image/png;base64,...')")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise _bad_image(f"image {number}: the data URL is not valid base64 ({error})") from error


async def _fetch(client: httpx.AsyncClient, url: str, number: int, limit: int) -> bytes:
    """The URL's body, refused past `limit` bytes or the fetch time limit."""
    try:
        async with asyncio.timeout(image_fetch_seconds()):
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise _bad_image(f"image {number}: fetching {url} answered HTTP {response.status_code}")
                body = bytearray()
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > limit:
                        raise _bad_image(f"image {number}: {url} is larger than {limit} bytes", "image_too_large")
                return bytes(body)
    except TimeoutError as error:
        raise _bad_image(f"image {number}: fetching {url} took longer than {image_fetch_seconds():g} s") from error
    except httpx.HTTPError as error:
        raise _bad_image(f"image {number}: fetching {url} failed: {error}") from error


def _checked(data: bytes, number: int, store: Path | None, holder: NodeId) -> ImageInput:
    """The bytes as an image: decodable, within the byte and pixel limits."""
    if len(data) > max_image_bytes():
        raise _bad_image(
            f"image {number} is {len(data)} bytes, over the limit of {max_image_bytes()}", "image_too_large"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                size, kind = image.size, image.format or "unknown"
                image.load()
    except Exception as error:  # PIL raises many kinds for bytes that are no image
        raise _bad_image(f"image {number} could not be decoded as an image ({type(error).__name__})") from error
    if size[0] * size[1] > max_image_pixels():
        raise _bad_image(
            f"image {number} is {size[0]}x{size[1]} pixels, over the limit of {max_image_pixels()}", "image_too_large"
        )
    image = ImageInput(
        sha256=hashlib.sha256(data).hexdigest(),
        media_type=Image.MIME.get(kind, "application/octet-stream"),
        width=size[0],
        height=size[1],
        size_bytes=len(data),
    )
    if store is None:
        return image.model_copy(update={"data_base64": base64.b64encode(data).decode()})
    put_image(store, data)
    return image.model_copy(update={"holder": holder})


def _media_kinds(params: TextGenerationTaskParams) -> set[str]:
    return {
        str(part.get("type"))
        for message in params.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.get("type") in MEDIA_PARTS
    }


async def resolve_images(
    card: ModelCard, params: TextGenerationTaskParams, store: Path | None, holder: NodeId
) -> TextGenerationTaskParams:
    """The request with its images named by hash, listed once in `images`, their bytes
    in `store` (this node's, `holder`)."""
    kinds = _media_kinds(params)
    if not kinds:
        return params
    unsupported = kinds - IMAGE_PARTS if "vision" in card.capabilities else kinds
    if unsupported:
        reason = (
            "the model takes text and images only" if "vision" in card.capabilities else "the model takes text only"
        )
        raise ApiError(
            400,
            f"{params.model} cannot read {', '.join(sorted(unsupported))} content: {reason}",
            code="unsupported_content",
            param="messages",
        )
    found: dict[str, ImageInput] = {}
    messages: list[ChatMessage] = []
    count = 0
    async with httpx.AsyncClient(follow_redirects=True, timeout=image_fetch_seconds()) as client:
        for message in params.messages:
            if not isinstance(message.content, list):
                messages.append(message)
                continue
            parts: list[dict] = []
            for part in message.content:
                if part.get("type") not in IMAGE_PARTS:
                    parts.append(part)
                    continue
                count += 1
                if count > max_images():
                    raise _bad_image(f"the request has more than {max_images()} images", "too_many_images")
                data = await _image_bytes(client, _part_url(part), count)
                image = await asyncio.to_thread(_checked, data, count, store, holder)
                found.setdefault(image.sha256, image)
                parts.append({"type": "image", "sha256": image.sha256})
            messages.append(message.model_copy(update={"content": parts}))
    return params.model_copy(update={"messages": messages, "images": list(found.values())})


async def _image_bytes(client: httpx.AsyncClient, url: str, number: int) -> bytes:
    if url.startswith("data:"):
        return _from_data_url(url, number)
    if url.startswith(("http://", "https://")):
        return await _fetch(client, url, number, max_image_bytes())
    shown = url[:40] + ("..." if len(url) > 40 else "")
    raise _bad_image(f"image {number}: '{shown}' is neither a data URL nor an http(s) URL")
