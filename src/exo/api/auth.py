"""API keys (--api-key): with any set, every request needs one, except the health check
(GET /node_id: the node's id and nothing else; nodes and scripts poll it) and the
dashboard's static files (the page asks for the key and sends it on its own calls).

A key comes as `Authorization: Bearer KEY` (OpenAI, Ollama clients, curl) or
`x-api-key: KEY` (Anthropic). The peer endpoints other nodes call (link probes, the
peer file hub, the peer image store) also take the cluster's peer token
(routing/seal.py's `peer_token`); with a cluster secret they need it even when the node
has no API key.
Keys are compared in constant time, and neither they nor the headers reach the log."""

import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api.errors import error_response
from exo.shared.image_store import PEER_IMAGES_PREFIX
from exo.worker.download.hub import PEER_HUB_PREFIX

HEALTH_PATH = "/node_id"
PEER_PREFIXES = (PEER_HUB_PREFIX, PEER_IMAGES_PREFIX, "/link_probe")
DASHBOARD = "/dashboard"


def is_public(method: str, path: str) -> bool:
    if method not in ("GET", "HEAD"):
        return False
    return path in ("/", HEALTH_PATH, DASHBOARD) or path.startswith(DASHBOARD + "/")


def presented_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    keys = []
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        keys.append(token.strip())
    if headers.get(b"x-api-key", b"").strip():
        keys.append(headers[b"x-api-key"].strip())
    return keys


def matches(presented: list[bytes], allowed: list[bytes]) -> bool:
    # Every pair is compared, so the time taken says nothing about which key came close.
    found = False
    for given in presented:
        for key in allowed:
            found |= hmac.compare_digest(given, key)
    return found


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], peer_token: str | None) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.peer_keys = [*self.keys, *([peer_token.encode()] if peer_token else [])]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_public(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        # A cluster secret alone (no --api-key) closes the peer paths to nodes without it.
        allowed = self.peer_keys if scope["path"].startswith(PEER_PREFIXES) else self.keys
        if not allowed:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(dict(scope["headers"]))
        if matches(presented, allowed):
            await self.app(scope, receive, send)
            return
        message = (
            "invalid API key"
            if presented
            else "this exo node needs an API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`"
        )
        response = error_response(Request(scope), 401, message, "invalid_request_error", code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
