"""Two plain ASGI middlewares every route gets: one log line per request, and JSON bodies
read as JSON whatever Content-Type they came with."""

import json
import re
import time

from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Where a request names its model: every generation API puts "model" in its JSON body.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,200})"')
# How much of a request body is searched for the model, and of an error body kept.
_SCAN_BYTES = 1 << 20
_ERROR_BYTES = 8192
# The dashboard polls these every second and peers probe the links every few seconds;
# their successes would drown everything else.
_QUIET_PREFIXES = ("/state", "/dashboard", "/events", "/instance/previews", "/node_id", "/link_probe")


def _error_message(body: bytes) -> str:
    """The message of an error body in any API's shape (OpenAI's and Claude's
    error.message, Ollama's error)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else parsed)[:500]


class RequestLog:
    """Logs method, path, status, duration, the request's model and, for a 4xx or 5xx,
    the error message, once the response has ended. No bodies, headers or query strings
    (where keys travel) reach the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        head = bytearray()
        status = 500
        error_body = bytearray()

        async def reading() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(head) < _SCAN_BYTES:
                head.extend(message.get("body", b"")[: _SCAN_BYTES - len(head)])
            return message

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(error_body) < _ERROR_BYTES:
                error_body.extend(message.get("body", b"")[: _ERROR_BYTES - len(error_body)])
            await send(message)

        try:
            await self.app(scope, reading, sending)
        finally:
            self._log(scope, status, time.perf_counter() - started, bytes(head), bytes(error_body))

    def _log(self, scope: Scope, status: int, seconds: float, head: bytes, error_body: bytes) -> None:
        path: str = scope["path"]
        line = f"{scope['method']} {path} {status} {seconds * 1000:.0f} ms"
        model = _MODEL_FIELD.search(head)
        if model is not None:
            line += f" model={model.group(1).decode(errors='replace')}"
        if status >= 400:
            line += f": {_error_message(error_body)}"
        quiet = status < 400 and path.startswith(_QUIET_PREFIXES)
        logger.log("DEBUG" if quiet else "INFO", line)


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


class JsonBodies:
    """Gives a request with a body but no JSON Content-Type (litellm's Ollama provider
    sends none, curl -d sends a form type) application/json, as real Ollama and OpenAI
    read such bodies as JSON anyway. No route takes form data."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            content_type = dict(scope["headers"]).get(b"content-type", b"")
            if not _is_json(content_type):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
