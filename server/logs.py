"""Structured JSON logs, one object per line, with the request id where there is one."""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
_VALID_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,  # with --workers, which process (engine or which worker) wrote it
        }
        if request_id.get():
            entry["request_id"] = request_id.get()
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own lines in the same shape
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def _clipped(query: bytes, limit: int = 1024) -> str:
    """A query string for the access log: an attacker-sized one is cut (with its length said)."""
    text = query[:limit].decode("latin-1")
    return text if len(query) <= limit else f"{text}... ({len(query)} bytes)"


class RequestLog:
    """ASGI middleware: a request id per request (the client's `x-request-id` if sane), echoed in
    the response and on every log line written while serving it, and one access line at the end."""

    def __init__(self, app):
        self.app = app
        self.log = logging.getLogger("tmod.access")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _VALID_ID.match(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.log.info(
                "request", extra={
                    "method": scope["method"], "path": scope["path"], "query": _clipped(scope.get("query_string", b"")),
                    "status": status, "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                },
            )
            request_id.reset(token)
