"""One error shape for every failure: {"error": {"type", "message", ...}}."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, **details: Any):
        super().__init__(message)
        self.status, self.type, self.message, self.details = status, type_, message, details


def error_body(type_: str, message: str, **details: Any) -> dict:
    return {"error": {"type": type_, "message": message, **details}}


def _count(request: Request, type_: str) -> None:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        runtime.metrics.requests.labels("error").inc()
        runtime.metrics.errors.labels(type_).inc()


async def api_error_handler(request: Request, exc: ApiError) -> JSONResponse:
    _count(request, exc.type)
    if request.url.path.startswith("/v2/"):
        # the Open Inference Protocol puts the message string in "error"; its clients read it there
        return JSONResponse({"error": exc.message, "type": exc.type, **exc.details}, status_code=exc.status)
    return JSONResponse(error_body(exc.type, exc.message, **exc.details), status_code=exc.status)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append({"location": where, "message": err.get("msg", "invalid")})
    _count(request, "invalid_request")
    summary = "; ".join(f"{p['location']}: {p['message']}" for p in problems[:5])
    return JSONResponse(
        error_body("invalid_request", f"request is malformed: {summary}", problems=problems), status_code=422
    )


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and "parsing the body" in str(exc.detail):
        # FastAPI's wording for a body that is not UTF-8 at all; say so, with the status of a bad body
        _count(request, "invalid_request")
        return JSONResponse(
            error_body("invalid_request", "request body is not valid UTF-8 encoded JSON"), status_code=422
        )
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    _count(request, type_)
    return JSONResponse(error_body(type_, str(exc.detail)), status_code=exc.status_code)


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # The worker stays up; the client gets the shape it expects instead of a bare 500 page.
    _count(request, "internal_error")
    return JSONResponse(error_body("internal_error", f"{type(exc).__name__}: {exc}"), status_code=500)
