"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_type(status_code: int) -> str:
    if status_code == 404:
        return "not_found_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


async def api_error_handler(_request: Request, error: ApiError) -> JSONResponse:
    body = error_body(error.message, _error_type(error.status_code), error.code, error.param)
    return JSONResponse(body, status_code=error.status_code)


async def validation_error_handler(_request: Request, error: RequestValidationError) -> JSONResponse:
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
    return JSONResponse(error_body(message, "invalid_request_error", "invalid_request", param), status_code=400)


async def http_error_handler(_request: Request, error: StarletteHTTPException) -> JSONResponse:
    detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
    return JSONResponse(error_body(detail, _error_type(error.status_code)), status_code=error.status_code)


async def unexpected_error_handler(_request: Request, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)
