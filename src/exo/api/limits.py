"""Request bodies over a size limit are refused with 413 before anything parses them."""

import os

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


def max_request_bytes() -> int:
    """EXO_MAX_REQUEST_BYTES, or 32 MiB."""
    return int(os.environ.get("EXO_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES))


class RequestSizeLimit:
    """Checks the declared Content-Length up front, and counts the bytes of bodies sent
    without one (chunked) as the app reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self) -> str:
        return f"request body is larger than the limit of {self.limit} bytes (EXO_MAX_REQUEST_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = error_response(Request(scope), 413, self._too_large(), code="request_too_large")
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException raised while reading the body on to
                    # the app's handler, which answers in the API's error shape.
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counting_receive, send)
