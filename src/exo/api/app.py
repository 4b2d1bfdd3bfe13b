"""The HTTP API every node serves."""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from exo.api.auth import ApiKeys
from exo.api.errors import (
    ApiError,
    api_error_handler,
    http_error_handler,
    unexpected_error_handler,
    validation_error_handler,
)
from exo.api.limits import RequestSizeLimit, max_request_bytes
from exo.api.middleware import JsonBodies, RequestLog
from exo.api.placing import AutoPlacer
from exo.api.port import ClusterPort
from exo.api.routers import cancel, claude, cluster, completions, downloads, ollama, openai_chat, responses


def create_app(port: ClusterPort) -> FastAPI:
    """The app serving every API family against this port to the cluster."""
    app = FastAPI(title="exo")
    app.state.cluster = port
    app.state.auto_placer = AutoPlacer()
    # The last one added runs first: the log sees every answer, the size limit's 413 too.
    app.add_middleware(JsonBodies)
    app.add_middleware(RequestSizeLimit, limit=max_request_bytes())
    # Inside CORS, so a browser's preflight is answered and a 401 carries CORS headers.
    app.add_middleware(ApiKeys, keys=port.settings.api_keys, peer_token=port.settings.peer_token)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestLog)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    app.include_router(cluster.router)
    app.include_router(downloads.router)
    app.include_router(openai_chat.router)
    app.include_router(claude.router)
    app.include_router(responses.router)
    app.include_router(completions.router)
    app.include_router(ollama.router)
    app.include_router(cancel.router)
    app.mount("/dashboard", StaticFiles(packages=[("exo", "resources/dashboard")], html=True), name="dashboard")

    # HEAD too: Claude Code probes the root on every run.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def dashboard() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    return app
