"""The bytes of a task's images, for the runner that runs it (the one holding rank 0; it
alone runs the vision tower). The task names each image by hash and by the node whose
API took the request (api/images.py stored the bytes there): the worker reads them from
its own image store (shared/image_store.py), or first takes them once from the holder's
/peer-images (api/peer_images.py), checks their hash and keeps them. Only the pipe to
the runner carries the bytes; a later turn repeating an image finds it here."""

import asyncio
import base64
import hashlib
from pathlib import Path

import httpx
from loguru import logger

from exo.shared.image_store import PEER_IMAGES_PREFIX, get_image, put_image
from exo.shared.types.common import NodeId
from exo.shared.types.state import State
from exo.shared.types.tasks import TextGenerationTask
from exo.shared.types.text_generation import ImageInput

FETCH_SECONDS = 30.0


def peer_api(state: State, node_id: NodeId, peer: NodeId) -> str | None:
    """The base URL of `peer`'s API as seen from `node_id`, if there is a link to it."""
    connection = state.topology.connection(node_id, peer)
    node = state.nodes.get(peer)
    if peer == node_id or connection is None or node is None:
        return None
    return f"http://{connection.sink_ip}:{node.api_port}"


class ImageFetchError(Exception):
    pass


async def with_image_bytes(
    task: TextGenerationTask, store: Path, state: State, node_id: NodeId, peer_token: str | None
) -> TextGenerationTask:
    """`task` with every image's bytes in it; an image it cannot get stays without them
    (the engine then fails the request, naming it)."""
    images = task.params.images
    if all(image.data_base64 for image in images):
        return task
    filled = [await _filled(image, store, state, node_id, peer_token) for image in images]
    return task.model_copy(update={"params": task.params.model_copy(update={"images": filled})})


async def _filled(image: ImageInput, store: Path, state: State, node_id: NodeId, peer_token: str | None) -> ImageInput:
    if image.data_base64:
        return image
    data = await asyncio.to_thread(get_image, store, image.sha256)
    if data is None and image.holder is not None:
        try:
            data = await _fetch(image, state, node_id, peer_token)
        except ImageFetchError as error:
            logger.error(f"image {image.sha256[:12]}: {error}")
            return image
        await asyncio.to_thread(put_image, store, data)
    return image if data is None else image.model_copy(update={"data_base64": base64.b64encode(data).decode()})


async def _fetch(image: ImageInput, state: State, node_id: NodeId, peer_token: str | None) -> bytes:
    assert image.holder is not None
    base = peer_api(state, node_id, image.holder)
    if base is None:
        raise ImageFetchError(f"no link to node {image.holder}, which holds it")
    headers = {"Authorization": f"Bearer {peer_token}"} if peer_token else None
    try:
        async with httpx.AsyncClient(timeout=FETCH_SECONDS, headers=headers) as client:
            response = await client.get(f"{base}{PEER_IMAGES_PREFIX}/{image.sha256}")
    except httpx.HTTPError as error:
        raise ImageFetchError(f"fetching it from node {image.holder} failed: {error}") from error
    if response.status_code != 200:
        raise ImageFetchError(f"node {image.holder} answered HTTP {response.status_code}")
    if hashlib.sha256(response.content).hexdigest() != image.sha256:
        raise ImageFetchError(f"node {image.holder} sent bytes of another hash")
    logger.info(f"image {image.sha256[:12]}: {len(response.content)} bytes taken from node {image.holder}")
    return response.content
