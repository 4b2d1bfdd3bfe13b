"""This node's image store (shared/image_store.py), served to its peers under
/peer-images on the API port: the worker of the node that runs a task takes an image it
lacks from the node whose API took the request (worker/images.py). Peer-token protected
like /peer-hub (api/auth.py)."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from exo.api.port import ClusterDep
from exo.shared.image_store import PEER_IMAGES_PREFIX, get_image

router = APIRouter(prefix=PEER_IMAGES_PREFIX)


@router.get("/{sha256}", include_in_schema=False)
async def peer_image(cluster: ClusterDep, sha256: str) -> Response:
    store = cluster.settings.images_dir
    data = None if store is None else await asyncio.to_thread(get_image, store, sha256)
    if data is None:
        return JSONResponse({"error": f"image {sha256} is not held by this node"}, status_code=404)
    return Response(data, media_type="application/octet-stream")
