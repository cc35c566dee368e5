"""Limits on what one connection may cost before its request reaches a route.

- `BodyLimits` (ASGI middleware): a body over `max_body_bytes` (declared or streamed, chunked
  included) answers 413; a body still arriving `body_timeout_s` after it began answers 408. A body
  sent with `Content-Encoding: gzip` or `deflate` (tritonclient's request compression) is read
  decompressed, and its decompressed size meets the same limit as it is inflated (a zip bomb costs
  at most `max_body_bytes` of memory); any other content coding answers 415.
- `header_timeout_protocol` (uvicorn's h11 protocol, subclassed; tmod-serve runs h11 on asyncio's loop,
  `uvicorn_config`): a connection that has not sent a whole request head within
  `header_timeout_s` (from connecting, or from the end of its previous response) is answered 408
  and closed; a client trickling headers a byte at a time holds nothing for long. uvicorn's own
  `timeout_keep_alive` covers idle connections between requests only once a first request was
  answered, and no timer at all covers a request head still arriving. A request the parser
  refuses (malformed, a head over `max_header_bytes` with h11) gets its 400 as JSON, in tmod's shape.
  The same protocol keeps two framing rules: a request with both Content-Length and
  Transfer-Encoding is answered 400 and its connection closed (RFC 9112 section 6.1: a request
  smuggled in its body is never read), and every response on a connection that will close after it
  says `Connection: close` (h11 does not add it; httptools does): on SIGTERM (`shutdown`) the
  requests in flight are answered so, and a keep-alive client does not send its next request into a
  connection being closed. An idle keep-alive connection is closed at SIGTERM only after
  `IDLE_DRAIN_GRACE_S` without a request: one its client had already sent is answered (and closed).
"""
from __future__ import annotations

import asyncio
import json
import re
import zlib

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import BodyRefused, error_body, error_response

DIGITS = re.compile(rb"[0-9]{1,18}")  # str.isdigit() is true for '²', which int() refuses
# request content codings read (zlib's window bits: gzip's header, or zlib's for HTTP's "deflate")
CODINGS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
CLOSE = (b"connection", b"close")
IDLE_DRAIN_GRACE_S = 0.5  # an idle keep-alive connection at SIGTERM: time for a request already sent to arrive


class BodyLimits:
    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and DIGITS.fullmatch(declared) and int(declared) > self.limit:
            raise self.too_large()
        coding = headers.get(b"content-encoding", b"identity").strip().lower()
        inflate = None
        if coding != b"identity":
            if coding not in CODINGS:
                raise BodyRefused(415, "unsupported_content_encoding",
                                  f"request Content-Encoding {coding.decode('latin-1')[:40]!r} is not read; "
                                  "send gzip, deflate or none", headers={"accept-encoding": "gzip, deflate"})
            inflate = Inflater(CODINGS[coding], self.limit, self.too_large)
            # the route reads the inflated body: the wire's length and coding no longer describe it
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                          if k not in (b"content-encoding", b"content-length")]}
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
                if inflate is not None:
                    message = {**message, "body": inflate.feed(message.get("body", b""), complete)}
            return message

        await self.app(scope, limited_receive, send)

    def too_large(self) -> BodyRefused:
        return BodyRefused(413, "payload_too_large", f"request body exceeds {self.limit} bytes")


class Inflater:
    """A compressed body inflated as it arrives, never past `limit` bytes: zlib is asked for at most
    one byte more than the room left, so a bomb stops at the limit, not at its inflated size."""

    def __init__(self, wbits: int, limit: int, too_large):
        self.decompressor = zlib.decompressobj(wbits)
        self.room, self.too_large = limit, too_large

    def feed(self, data: bytes, last: bool) -> bytes:
        try:
            out = self.decompressor.decompress(data, self.room + 1)
        except zlib.error as exc:
            raise BodyRefused(400, "invalid_request", f"request body is not valid for its Content-Encoding: {exc}") \
                from None
        if len(out) > self.room:
            raise self.too_large()
        self.room -= len(out)
        if last and (not self.decompressor.eof or self.decompressor.unused_data):
            raise BodyRefused(400, "invalid_request", "request body is not one whole stream of its Content-Encoding")
        return out


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
        _draining = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.app = framing_rules(self, self.app)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def shutdown(self) -> None:
            """SIGTERM: the request in flight is answered with `Connection: close` (`framing_rules`); an
            idle connection gets `IDLE_DRAIN_GRACE_S` for a request its client already sent."""
            if self._draining:
                return
            self._draining = True
            if self._waiting_for_head():
                self._disarm()
                self.loop.call_later(IDLE_DRAIN_GRACE_S, self._close_if_idle)
            else:
                super().shutdown()

        def _close_if_idle(self) -> None:
            if self._waiting_for_head() and not self.transport.is_closing():
                super().shutdown()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head() and not self._draining:
                self._arm()  # a request head starts (after an idle keep-alive wait, which this data ended)
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm()
                if self._draining:
                    self.cycle.keep_alive = False  # a request that came in the grace: answered, then closed

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


def framing_rules(protocol, app):
    """The ASGI app as one connection's protocol runs it: a request with both Content-Length and
    Transfer-Encoding is answered 400 (in its route's protocol shape) and the connection closed, its
    body never read; a response on a connection that closes after it (uvicorn's `cycle.keep_alive`
    false: on SIGTERM, or after such a refusal) says `Connection: close` (a request's own
    `Connection: close` is answered so by uvicorn already)."""

    async def framed(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        cycle = protocol.cycle  # the cycle this request runs in: a connection runs one at a time

        async def send_closing(message):
            if message["type"] == "http.response.start" and not cycle.keep_alive \
                    and CLOSE not in message.get("headers", []):
                message = {**message, "headers": [*message.get("headers", []), CLOSE]}
            await send(message)

        names = {name for name, _ in scope["headers"]}
        if b"transfer-encoding" in names and b"content-length" in names:
            cycle.keep_alive = False
            refusal = error_response(scope["path"], 400, "invalid_http",
                                     "request has both Content-Length and Transfer-Encoding (RFC 9112 section 6.1); "
                                     "the connection is closed")
            return await refusal(scope, receive, send_closing)
        await app(scope, receive, send_closing)

    return framed
