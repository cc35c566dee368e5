"""Limits on what one connection may cost before its request reaches a route.

- `BodyLimits` (ASGI middleware): a body over `max_body_bytes` (declared or streamed, chunked
  included) answers 413; a body still arriving `body_timeout_s` after it began answers 408.
- `header_timeout_protocol` (uvicorn's h11 protocol, subclassed; tmod-serve runs h11 on asyncio's loop,
  `uvicorn_config`): a connection that has not sent a whole request head within
  `header_timeout_s` (from connecting, or from the end of its previous response) is answered 408
  and closed; a client trickling headers a byte at a time holds nothing for long. uvicorn's own
  `timeout_keep_alive` covers idle connections between requests only once a first request was
  answered, and no timer at all covers a request head still arriving. A request the parser
  refuses (malformed, a head over `max_header_bytes` with h11) gets its 400 as JSON, in tmod's shape.
"""
from __future__ import annotations

import asyncio
import json
import re

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import BodyRefused, error_body

DIGITS = re.compile(rb"[0-9]{1,18}")  # str.isdigit() is true for '²', which int() refuses


class BodyLimits:
    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and DIGITS.fullmatch(declared) and int(declared) > self.limit:
            raise self.too_large()
        seen = 0
        deadline: float | None = None  # set when the body starts arriving
        complete = False

        async def limited_receive():
            nonlocal seen, deadline, complete
            if complete:  # the whole body is in: later receives wait for a disconnect, unbounded
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyRefused(408, "request_timeout",
                                  f"request body not received within {self.timeout_s:g} s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise self.too_large()
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def too_large(self) -> BodyRefused:
        return BodyRefused(413, "payload_too_large", f"request body exceeds {self.limit} bytes")


def raw_response(status: str, type_: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, written below the parser (no request id:
    no request was read)."""
    body = json.dumps(error_body(type_, message)).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a deadline on each request head (see the module docstring)."""
    timeout_response = raw_response("408 Request Timeout", "request_timeout",
                                     f"request head not received within {header_timeout_s:g} s")

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _graced = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm()  # a request head starts (after an idle keep-alive wait, which this data ended)
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self, graced: bool = False) -> None:
            if self._head_timer is None:
                self._graced = graced
                self._head_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            late = self.loop.time() - self._head_timer.when()
            self._head_timer = None
            if late > min(1.0, header_timeout_s / 2) and not self._graced:
                # the timer fired late: the event loop was busy (a burst), so this connection's head
                # may be waiting unread too. Overload is answered by the queue (429), not here: one
                # more period before it counts as slow
                self._arm(graced=True)
                return
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.write(timeout_response)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(raw_response("400 Bad Request", "invalid_http", msg))
                self.transport.close()

    return HeaderTimeoutProtocol


def uvicorn_config(app, settings) -> uvicorn.Config:
    """uvicorn for tmod: our JSON lines replace its access log; request heads have a deadline
    (`header_timeout_s`, `header_timeout_protocol`). h11 on asyncio's loop, not the httptools / uvloop
    uvicorn would pick where installed: with httptools, SIGTERM under load dropped 7 to 36 of 500
    requests without an answer (connections accepted but not yet read are closed), with h11 none
    (2026-11-23, bench/bench_attack.py's SIGTERM check, on this code and on e33efaf's alike)."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          log_config=None, access_log=False, loop="asyncio",
                          http=header_timeout_protocol(settings.header_timeout_s),
                          h11_max_incomplete_event_size=settings.max_header_bytes)
