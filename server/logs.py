"""Logs: structured JSON, one object per line (what a log collector parses), or plain text lines on a
terminal; with the request id where there is one."""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
_VALID_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")
# W3C Trace Context: version-traceid-parentid-flags (a later version may add fields after them)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}(?:-.*)?$")
# a record's attributes that are not extra fields: the standard ones, and uvicorn's `color_message`
# (its message with terminal colour codes, for a console, not a JSON line)
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}
# uvicorn writes its server's lines (started, shutting down, ...) as logger "uvicorn.error" whatever their
# level: "info uvicorn.error: Started server process" reads as an error and matches a search for errors
LOGGER_NAMES = {"uvicorn.error": "uvicorn"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record), default=str)

    def fields(self, record: logging.LogRecord) -> dict:
        """A line's fields: time, level, logger, message, process, request id, the record's extra fields."""
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": LOGGER_NAMES.get(record.name, record.name),
            "message": record.getMessage(),
            "pid": record.process,  # with --workers, which process (engine or which worker) wrote it
        }
        if request_id.get():
            entry["request_id"] = request_id.get()
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return entry


class TextFormatter(JsonFormatter):
    """The JSON line's fields as one line a person reads: time, level, logger, message, then the extra
    fields (request id, an access line's method, path, status, ...) as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        entry = self.fields(record)
        head = f"{entry.pop('ts')} {entry.pop('level'):<7} {entry.pop('logger')}: {entry.pop('message')}"
        entry.pop("pid")
        exception = entry.pop("exception", None)
        extras = " ".join(f"{k}={v}" for k, v in entry.items())
        return head + (f" {extras}" if extras else "") + (f"\n{exception}" if exception else "")


def log_formatter(log_format: str = "auto") -> logging.Formatter:
    """json, text, or auto: text where stderr is a terminal (a person starting the server), JSON
    everywhere else (a container, a service, a file)."""
    text = log_format == "text" or (log_format == "auto" and sys.stderr.isatty())
    return TextFormatter() if text else JsonFormatter()


def configure_logging(level: str = "info", log_format: str = "auto") -> None:
    """Every line the process writes goes through one formatter (`log_formatter`: a JSON object a log
    collector parses, or text on a terminal): tmod's, uvicorn's, transformers' (which has a handler of
    its own) and Python warnings; transformers' "Loading weights" progress bar is off (the log says how
    long loading took)."""
    from transformers.utils import logging as transformers_logging

    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own lines in the same shape
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()
    logging.captureWarnings(True)


def _clipped(query: bytes, limit: int = 1024) -> str:
    """A query string for the access log: an attacker-sized one is cut (with its length said)."""
    text = query[:limit].decode("latin-1")
    return text if len(query) <= limit else f"{text}... ({len(query)} bytes)"


def request_id_for(headers) -> str:
    """The client's `x-request-id` if sane; else the trace id of a valid W3C `traceparent`, so a request's
    log lines carry the id of the trace it belongs to; else a fresh one."""
    traced = None
    for name, value in headers:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if _VALID_ID.match(given):
                return given
        elif name == b"traceparent" and traced is None:
            traced = _TRACEPARENT.match(value.decode("latin-1"))
    if traced and traced[1] != "ff" and traced[2] != "0" * 32:  # version ff and an all-zero trace id are invalid
        return traced[2]
    return os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID object


# health probes: a supervisor's, every few seconds all day (a kubelet's two, Docker's HEALTHCHECK)
PROBES = frozenset({"/healthz", "/readyz", "/health", "/v2/health/live", "/v2/health/ready"})


class AccessLog:
    """One access line per request (`tmod.access`, at info; a probe answered 2xx, at debug), at most
    `per_second` lines a second in this process: a JSON line costs ~24 us of CPU written to /dev/null
    (docs/host-path-log.md, issue 37's worker side; ~120 us in the issue's first study), so at high
    rates lines are sampled (a token bucket holding one second's lines); the next line written says how
    many were `skipped` since the one before. 0: no access lines. The metrics count every request."""

    def __init__(self, per_second: float):
        self.log = logging.getLogger("tmod.access")
        self.per_second, self.tokens, self.last, self.skipped = per_second, per_second, time.monotonic(), 0

    def write(self, scope, status: int, seconds: float) -> None:
        level = logging.DEBUG if status < 300 and scope["path"] in PROBES else logging.INFO
        if self.per_second <= 0 or not self.log.isEnabledFor(level):
            return
        now = time.monotonic()
        self.tokens = min(self.per_second, self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens < 1.0:
            self.skipped += 1
            return
        self.tokens -= 1.0
        extra = {"method": scope["method"], "path": scope["path"], "query": _clipped(scope.get("query_string", b"")),
                 "status": status, "duration_ms": round(seconds * 1000, 3)}
        if self.skipped:
            extra["skipped"], self.skipped = self.skipped, 0
        self.log.log(level, "request", extra=extra)
