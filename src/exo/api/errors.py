"""Errors in the shape of the API the request was for: OpenAI's
{"error": {"message", "type", "param", "code"}} by default, Anthropic's
{"type": "error", "error": {"type", "message"}} under /v1/messages, and Ollama's
{"error": "message"} under /ollama/."""

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        # Seconds, sent as a Retry-After header: when a retry may succeed.
        self.retry_after = retry_after


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_type(status_code: int) -> str:
    if status_code == 404:
        return "not_found_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def _anthropic_error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 413:
        return "request_too_large"
    if status_code == 503:
        return "overloaded_error"
    if status_code < 500:
        return "invalid_request_error"
    return "api_error"


def anthropic_error_body(message: str, status_code: int) -> dict:
    return {"type": "error", "error": {"type": _anthropic_error_type(status_code), "message": message}}


def error_response(
    request: Request,
    status_code: int,
    message: str,
    error_type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    path = request.url.path
    if path.startswith("/v1/messages"):
        body = anthropic_error_body(message, status_code)
    elif path.startswith("/ollama/"):
        body = {"error": message}
    else:
        body = error_body(message, error_type or _error_type(status_code), code, param)
    return JSONResponse(body, status_code=status_code)


# Starlette hands every handler a plain Exception; each is registered for one class.


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    response = error_response(request, error.status_code, error.message, code=error.code, param=error.param)
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    return response


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    first = problems[0] if problems else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = "request body is not valid JSON"
    else:
        details = "; ".join(
            f"{'.'.join(str(p) for p in problem.get('loc', ()) if p != 'body') or 'body'}: {problem.get('msg')}"
            for problem in problems
        )
        message = f"invalid request: {details}"
    return error_response(request, 400, message, "invalid_request_error", "invalid_request", param)


async def http_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
    return error_response(request, error.status_code, detail)


async def unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    return error_response(request, 500, f"internal error: {error}", "server_error")
