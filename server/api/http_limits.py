"""Limits on what one connection may cost before its request reaches a route.

- `limit_body` (server/api/app.py applies it to every request): a body over `max_body_bytes` (declared or streamed, chunked
  included) answers 413; a body still arriving `body_timeout_s` after it began answers 408. A body
  sent with `Content-Encoding: gzip` or `deflate` (tritonclient's request compression) is read
  decompressed, and its decompressed size meets the same limit as it is inflated (a zip bomb costs
  at most `max_body_bytes` of memory); any other content coding answers 415. The 408 closes the
  connection (`Connection: close`): what is left of that body is never read.
- `header_timeout_protocol` (uvicorn's httptools protocol, subclassed; tmod-serve runs it on uvloop,
  `uvicorn_config`): a connection that has not sent a whole request head within
  `header_timeout_s` (from connecting; on a kept-alive connection, from the head's first byte) is
  answered 408 and closed; a client trickling headers a byte at a time holds nothing for long.
  uvicorn's own `timeout_keep_alive` (`keep_alive_s`) covers idle connections between requests only
  once a first request was answered (and closes one only with no request unread on its socket: an event
  loop busy past the timeout runs the overdue timer before it reads), and no timer at all covers a
  request head still arriving. A head over
  `max_header_bytes` (httptools sets no limit of its own) and a request the parser refuses get
  a 400 as JSON, in tmod's shape, and the connection closed. A request with both Content-Length
  and Transfer-Encoding is refused by the parser before its body is read (RFC 9112 section 6.1: a
  request smuggled in its body is never read): answered 400 in the shape of the route it was sent
  to, connection closed.
- The drain (SIGTERM, `shutdown`): a request in flight, or one whose head is arriving, is answered
  with `Connection: close`, so a keep-alive client does not send its next request into a
  connection being closed. An idle keep-alive connection is closed only after
  `IDLE_DRAIN_GRACE_S` without a request: one its client had already sent (accepted, not yet read
  by the event loop, however long the loop is busy) is answered, and closed; a head begun in the
  grace meets the head deadline as any other. uvicorn's own httptools protocol closes such a
  connection at once, which lost 7 to 36 of 500 requests under load (bench/bench_attack.py, 2026-11-23).
"""
from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import socket
import sys
import termios
import threading
import urllib.parse
import zlib

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from server.config import STOP_SIGNALS
from server.errors import BodyRefused, error_body, protocol_of

DIGITS = re.compile(rb"[0-9]{1,18}")  # str.isdigit() is true for '²', which int() refuses
# request content codings read (zlib's window bits: gzip's header, or zlib's for HTTP's "deflate")
CODINGS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
IDLE_DRAIN_GRACE_S = 0.5  # an idle keep-alive connection at SIGTERM: time for a request already sent to arrive
FRAMING_MESSAGE = ("request has both Content-Length and Transfer-Encoding (RFC 9112 section 6.1); "
                   "the connection is closed")


def limit_body(scope, receive, limit: int, timeout_s: float):
    """-> (scope, receive) for the app: `receive` refuses (BodyRefused) a body over `limit` bytes as it
    arrives, or one still arriving `timeout_s` after it began; a declared length over the limit and an
    unknown content coding are refused at once. A gzip or deflate body is read inflated (the scope
    then no longer names the wire's length and coding)."""
    declared = coding = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared = value
        elif name == b"content-encoding":
            coding = value.strip().lower()
    if declared is not None and DIGITS.fullmatch(declared) and int(declared) > limit:
        raise too_large(limit)
    inflate = None
    if coding is not None and coding != b"identity":
        if coding not in CODINGS:
            raise BodyRefused(415, "unsupported_content_encoding",
                              f"request Content-Encoding {coding.decode('latin-1')[:40]!r} is not read; "
                              "send gzip, deflate or none", headers={"accept-encoding": "gzip, deflate"})
        inflate = Inflater(CODINGS[coding], limit, lambda: too_large(limit))
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
        deadline = deadline or loop.time() + timeout_s
        cycle = scope.get(CYCLE)
        if cycle is not None and cycle.message_event.is_set():
            message = await receive()  # what has arrived is read without waiting: nothing to time (most bodies)
        else:
            message = await timed_receive(receive, loop, deadline, timeout_s, cycle)
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(limit)
            complete = not message.get("more_body", False)
            if inflate is not None:
                message = {**message, "body": inflate.feed(message.get("body", b""), complete)}
        return message

    return scope, limited_receive


async def timed_receive(receive, loop, deadline: float, timeout_s: float, cycle):
    """`receive()`, refused with a 408 past `deadline` (the loop's clock). A timer that cancels this task,
    not asyncio.wait_for (a task per receive); it is cancelled unused when the body comes in time."""
    task, expired = asyncio.current_task(), []
    timer = loop.call_later(max(0.0, deadline - loop.time()), lambda: (expired.append(True), task.cancel()))
    try:
        return await receive()
    except asyncio.CancelledError:
        if not expired:
            raise
        task.uncancel()
        # the rest of this body may still come: closed after the 408 (RFC 9110 15.5.9), not left to
        # uvicorn's keep-alive timeout waiting for a body no route will read
        if cycle is not None:
            cycle.keep_alive = False
        raise BodyRefused(408, "request_timeout", f"request body not received within {timeout_s:g} s",
                          headers=None if cycle is not None else {"connection": "close"}) from None
    finally:
        timer.cancel()


def too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "payload_too_large", f"request body exceeds {limit} bytes")


async def read_body(receive) -> bytes:
    """The whole request body (what arrived before a disconnect)."""
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while message.get("more_body", False):
        message = await receive()
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


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


class HeadTooLarge(Exception):
    """Raised in the parser's callback: the head is refused before any route sees it."""


def raw_response(status: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, written below the parser (no request id:
    no request was read)."""
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def tmod_refusal(status: str, type_: str, message: str) -> bytes:
    return raw_response(status, json.dumps(error_body(type_, message)).encode())


def unread_bytes(transport) -> int:
    """Bytes that arrived on a connection's socket and were not read yet (0 where it cannot be told)."""
    try:
        counted = array.array("i", [0])
        fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, counted)
        return counted[0]
    except (AttributeError, OSError, ValueError):  # no socket (a test's transport), or closed (fileno -1)
        return 0


def header_timeout_protocol(header_timeout_s: float, max_header_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a deadline and a size limit on each request head, and a
    drain that loses nothing (see the module docstring)."""
    timeout_response = tmod_refusal("408 Request Timeout", "request_timeout",
                                     f"request head not received within {header_timeout_s:g} s")
    too_large = tmod_refusal("400 Bad Request", "invalid_http", f"request head exceeds {max_header_bytes} bytes")

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _graced = False
        _draining = False
        _in_head = False  # a request head has begun and is not complete
        _head_bytes = 0  # bytes read while a head was awaited or arriving
        _head_size = 0  # the arriving head's URL and headers

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = OneWriteTransport(transport, self.loop)  # the protocol and its cycles write through it
            self._arm()
            if getattr(self.server_state, "draining", False):  # taken in while the server stops (`DrainingServer`)
                self.shutdown()

        def shutdown(self) -> None:
            """SIGTERM: a request in flight, or one whose head is arriving, is answered with
            `Connection: close`; an idle connection gets `IDLE_DRAIN_GRACE_S` for a request its
            client already sent (bytes the event loop has not read yet), then is closed."""
            if self._draining:
                return
            self._draining = True
            if self._in_head:
                return  # `on_headers_complete` marks it closing; the head deadline still holds
            if self._waiting_for_head():
                self._disarm()
                self.loop.call_later(IDLE_DRAIN_GRACE_S, self._close_if_idle)
            else:
                super().shutdown()  # the cycle in flight: keep_alive False, answered with Connection: close

        def _close_if_idle(self) -> None:
            if self._waiting_for_head() and not self._in_head and not self.transport.is_closing():
                if unread_bytes(self.transport):  # a request came in the grace, the busy loop has not read it yet
                    self.loop.call_later(IDLE_DRAIN_GRACE_S, self._close_if_idle)
                else:
                    self.transport.close()

        def data_received(self, data: bytes) -> None:
            heading = self._waiting_for_head() or self._in_head
            if heading:
                self._head_bytes += len(data)
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._in_head and self._head_bytes > max_header_bytes:
                self.transport.write(too_large)  # a head still arriving, already over the limit
                self.transport.close()
            elif heading and (self._in_head or self._waiting_for_head()):
                # a request head started (after an idle keep-alive wait, which this data ended, or in the
                # stop's grace) and is not whole yet: its deadline runs from now. A head that came whole in
                # this data needs none (most: no timer made and cancelled per request)
                self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_size = True, 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._head_size += len(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._head_size += len(name) + len(value) + 4

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._disarm()
            if self._head_size > max_header_bytes:  # a whole head in one read: measured by its parts
                raise HeadTooLarge  # the parser stops; `send_400_response` answers
            super().on_headers_complete()
            self.scope[CYCLE] = self.cycle  # the app answers its inference routes through it (`answer_whole`)
            if self._draining:
                self.cycle.keep_alive = False  # a request that came in the grace: answered, then closed

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn's close of an idle kept-alive connection, unless a request has come in unread: the
            event loop, busy past `keep_alive_s`, runs the overdue timer before it reads the socket again
            (that request's client saw its connection closed: seen under load on 2 cores)."""
            if unread_bytes(self.transport) == 0:
                super().timeout_keep_alive_handler()

        def connection_lost(self, exc) -> None:
            self._disarm()
            # uvicorn stops the keep-alive timer only on a clean close; one reset by its client kept it
            # armed, and it fired on a closed socket
            self._unset_keepalive_if_required()
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
            if (self._waiting_for_head() or self._in_head) and not self.transport.is_closing():
                self.transport.write(timeout_response)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """A request the parser refused (called while its error is being handled), as JSON; Content-Length
            with Transfer-Encoding in the shape of the route it was sent to (its URL was read first)."""
            if self.transport.is_closing():
                return
            error = str(sys.exc_info()[1] or msg)
            if isinstance(sys.exc_info()[1].__context__, HeadTooLarge):
                self.transport.write(too_large)
            elif "Transfer-Encoding" in error and "Content-Length" in error:
                try:
                    path = urllib.parse.unquote(httptools.parse_url(self.url).path.decode("latin-1"))
                except (httptools.HttpParserInvalidURLError, AttributeError):
                    path = "/"
                shape, _ = protocol_of(path)
                self.transport.write(raw_response("400 Bad Request", json.dumps(
                    shape(400, "invalid_http", FRAMING_MESSAGE)).encode()))
            else:
                self.transport.write(tmod_refusal("400 Bad Request", "invalid_http",
                                                  f"invalid HTTP request: {error[:200]}"))
            self.transport.close()

    return HeaderTimeoutProtocol


# The scope key of a request's uvicorn cycle (`RequestResponseCycle`), present where tmod's protocol
# serves it (absent under other ASGI servers and test clients: answers then go the ASGI way)
CYCLE = "tmod.cycle"
_default_lines: tuple[list, bytes] = ([], b"")  # uvicorn's default headers (Date, Server) as lines, by their list


def answer_whole(cycle: RequestResponseCycle, status: int, lines: bytes, body: bytes) -> bool:
    """Answer a request at once, head and body in one write: its status line, uvicorn's default
    headers, `lines` (header lines the app made itself: ASCII, each ending in CRLF, Content-Length
    among them, no Connection) and `body`. What uvicorn's `send` does for a response start and its
    whole body, without checking each header against its patterns (~25 us of CPU a request, issue
    37): the app's header names are constants and its values numbers or checked ids. False where the
    answer must go the ASGI way (it has begun, or the transport asks the writer to wait). The cycle's
    transport is the protocol's `OneWriteTransport`."""
    if cycle.response_started or cycle.flow.write_paused:
        return False
    if cycle.disconnected:  # as uvicorn's send: the answer has nowhere to go
        return True
    global _default_lines
    defaults = cycle.default_headers
    if defaults is not _default_lines[0]:  # uvicorn makes a new list each second (its Date)
        _default_lines = defaults, b"".join(name + b": " + value + b"\r\n" for name, value in defaults)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    close = not cycle.keep_alive
    if cycle.scope["method"] == "HEAD":  # the head a GET would get, no body (as uvicorn's send)
        body = b""
    cycle.transport.write_whole(b"".join((STATUS_LINE[status], _default_lines[1], lines,
                                          b"connection: close\r\n\r\n" if close else b"\r\n", body)))
    cycle.response_complete = True
    cycle.message_event.set()
    if close:
        cycle.transport.close()
    cycle.on_response()
    return True


class OneWriteTransport:
    """A connection's transport whose writes of one event-loop iteration go to the socket together: a
    write is held until the next one (joined to it), a close, or the iteration's end. uvicorn writes an
    answer's head and its body separately, back to back: one system call instead of two per answer.
    Everything but `write` and `close` is the transport's own."""

    __slots__ = ("transport", "loop", "held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop, self.held = transport, loop, None

    def write(self, data: bytes) -> None:
        if self.held is None:
            self.held = data
            self.loop.call_soon(self.flush)
        else:
            self.transport.write(self.held + data)
            self.held = None

    def write_whole(self, data: bytes) -> None:
        """Write at once (after anything held): a whole answer has nothing to join."""
        if self.held is not None:
            data, self.held = self.held + data, None
        self.transport.write(data)

    def flush(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.transport.write(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name):
        return getattr(self.transport, name)


def uvicorn_config(app, settings) -> uvicorn.Config:
    """uvicorn for tmod: httptools on uvloop (compiled parser and loop: ~70-95 us less CPU per request
    than h11 on asyncio's loop, issue 37), our JSON lines replace its access log, request heads have a
    deadline and a size limit and the drain loses nothing (`header_timeout_protocol`)."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          log_config=None, access_log=False, loop="uvloop", timeout_keep_alive=settings.keep_alive_s,
                          proxy_headers=False,  # X-Forwarded-For is never read: no middleware rewriting it per request
                          http=header_timeout_protocol(settings.header_timeout_s, settings.max_header_bytes))


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first takes in the connections the kernel has already
    completed (its accept queue) and only then closes the listener: closed with them queued, the
    kernel resets them, and a client that had sent its request loses it. Taken in, each gets the
    drain of `header_timeout_protocol` (its request answered with `Connection: close`). It stops on
    each of server.config's STOP_SIGNALS: uvicorn's own (SIGTERM, SIGINT), and SIGHUP."""

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's raises each signal again once the server has drained: one process drained by SIGTERM
        then ended by it (exit status 143), by Ctrl-C in a KeyboardInterrupt, where `--workers N` exited 0.
        Drained is a clean stop: the process returns, exit status 0, whatever the layout."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's: the first signal drains. Ctrl-C again (its "force quit") used to cancel the requests
        in flight into plain-text 500s, log two tracebacks, and abort the process (SIGABRT) where a pass
        was running while the interpreter shut down: now the process ends at once, in one line."""
        super().handle_exit(sig, frame)
        if self.force_exit:
            logging.getLogger("tmod").warning("forced to stop (Ctrl-C twice): %d connection(s) closed unanswered",
                                              len(self.server_state.connections))
            os._exit(128 + sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.server_state.draining = True  # a connection made from now on drains from its start
        listeners = [s for server in getattr(self, "servers", ()) for s in (server.sockets or ())] + list(sockets or ())
        for listener in listeners:
            with socket.socket(fileno=os.dup(listener.fileno())) as sock:
                sock.setblocking(False)
                while True:
                    try:
                        connection, _ = sock.accept()
                    except OSError:  # nothing queued (EAGAIN), or not a listener
                        break
                    await loop.connect_accepted_socket(self._protocol, connection)
        for server in getattr(self, "servers", ()):  # at once, nothing awaited since the queue was found empty
            server.close()
        for listener in sockets or ():
            listener.close()
        await super().shutdown(sockets)

    def _protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                               app_state=self.lifespan.state)
