"""The HTTP layer's own parts against real sockets: the request head's size limit of the protocol
tmod-serve runs (httptools, `server/api/http_limits.py`), the sampled access log, and the OpenAPI
schema of the inference routes generated from their msgspec structs."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import msgspec
import pytest
import uvicorn

from server.api.http_limits import IDLE_DRAIN_GRACE_S, uvicorn_config
from server.config import Settings
from server.logs import AccessLog
from bench.live_server import free_port, read_until_closed, wait_until

LIMIT = 4096
GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def exchange(port: int, parts: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            for part in parts:
                sock.sendall(part)
        except OSError:  # refused midway: the server closed the connection
            pass
        return read_until_closed(sock)  # every exchange here ends with the server closing


class LoopHolder:
    """An app answering "ok" that remembers the server's event loop, and holds that loop busy in an
    I/O callback (as reading a burst of requests does) when asked: `hold`."""

    def __init__(self):
        self.loops, self.busy = [], threading.Event()
        self.wake, self.waker = socket.socketpair()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.loops.append(asyncio.get_running_loop())
        await ok_app(scope, receive, send)

    def hold(self, seconds: float) -> None:
        """The loop busy for `seconds` from now (returns once it is)."""
        def held():
            self.wake.recv(1)
            self.busy.set()
            time.sleep(seconds)

        loop = self.loops[0]
        loop.call_soon_threadsafe(loop.add_reader, self.wake.fileno(), held)
        time.sleep(0.05)
        self.waker.sendall(b"x")
        assert self.busy.wait(10)

    def close(self) -> None:
        self.wake.close()
        self.waker.close()


def serve(app, **limits) -> tuple[uvicorn.Server, threading.Thread, int]:
    """tmod's uvicorn (`uvicorn_config`) serving `app` on a thread: (server, thread, port)."""
    settings = Settings(port=free_port(), log_level="warning", **limits)
    server = uvicorn.Server(uvicorn_config(app, settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the server to start")
    return server, thread, settings.port


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def port():
    server, thread, port = serve(ok_app, max_header_bytes=LIMIT)
    yield port
    server.should_exit = True
    thread.join(30)


@pytest.mark.parametrize("size, status", [(LIMIT // 2, 200), (LIMIT + 100, 400)])
def test_a_head_over_the_limit_in_one_read_is_refused(port, size, status):
    received = exchange(port, [b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: " + b"b" * size + b"\r\n\r\n"])
    assert received.startswith(f"HTTP/1.1 {status} ".encode()), received[:200]
    if status == 400:
        error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "invalid_http" and str(LIMIT) in error["message"]
        assert b"connection: close" in received.lower()


def test_a_head_trickled_past_the_limit_is_refused_before_it_ends(port):
    headers = [b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(2 * LIMIT // 100)]
    received = exchange(port, [b"GET / HTTP/1.1\r\nhost: x\r\n", *headers])  # never ends its head
    assert received.startswith(b"HTTP/1.1 400 "), received[:200]


def test_a_request_id_is_the_clients_else_its_trace_id_else_new():
    """A request's id (its log lines' `request_id`, the answer's `x-request-id`): the client's x-request-id
    if sane, else the trace id of a W3C traceparent (log lines join the trace), else a fresh one."""
    from server.logs import request_id_for

    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace}-00f067aa0ba902b7-01"
    assert request_id_for([(b"traceparent", parent.encode())]) == trace
    assert request_id_for([(b"traceparent", parent.encode()), (b"x-request-id", b"mine-1")]) == "mine-1"
    assert request_id_for([(b"x-request-id", b"<bad>"), (b"traceparent", parent.encode())]) == trace
    assert request_id_for([(b"traceparent", f"01-{trace}-00f067aa0ba902b7-01-later".encode())]) == trace
    for invalid in (f"ff-{trace}-00f067aa0ba902b7-01", f"00-{'0' * 32}-00f067aa0ba902b7-01",
                    f"00-{trace.upper()}-00f067aa0ba902b7-01", f"00-{trace}-01", "garbage"):
        fresh = request_id_for([(b"traceparent", invalid.encode())])
        assert fresh != trace and len(fresh) == 32 and fresh != request_id_for([(b"traceparent", invalid.encode())])


def test_the_access_log_samples_at_high_rates(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr("server.logs.time.monotonic", lambda: now[0])
    log = AccessLog(per_second=5)
    scope = {"method": "POST", "path": "/v1/infer", "query_string": b""}
    with caplog.at_level(logging.INFO, logger="tmod.access"):
        for _ in range(50):  # 50 requests in one instant: one second's lines are written
            log.write(scope, 200, 0.001)
        assert len(caplog.records) == 5
        now[0] += 1.0
        log.write(scope, 200, 0.001)
        assert len(caplog.records) == 6 and caplog.records[-1].skipped == 45
        off = AccessLog(per_second=0)
        for _ in range(10):
            off.write(scope, 200, 0.001)
        assert len(caplog.records) == 6


def test_probes_answered_ok_are_logged_at_debug_and_failing_ones_at_info(caplog):
    """A kubelet's liveness and readiness probes, every few seconds all day, wrote an access line each at
    info; now those answered 2xx go at debug, a failing one (what an operator looks for) stays at info."""
    log = AccessLog(per_second=100)
    with caplog.at_level(logging.INFO, logger="tmod.access"):
        for path, status in (("/healthz", 200), ("/readyz", 200), ("/v2/health/ready", 200), ("/readyz", 503),
                             ("/v1/infer", 200)):
            log.write({"method": "GET", "path": path, "query_string": b""}, status, 0.001)
    assert [(r.path, r.status, r.levelno) for r in caplog.records] == [("/readyz", 503, logging.INFO),
                                                                      ("/v1/infer", 200, logging.INFO)]
    with caplog.at_level(logging.DEBUG, logger="tmod.access"):
        log.write({"method": "GET", "path": "/healthz", "query_string": b""}, 200, 0.001)
    assert (caplog.records[-1].path, caplog.records[-1].levelno) == ("/healthz", logging.DEBUG)


def test_the_inference_routes_schema_is_the_structs_schema():
    from server.api.app import create_app
    from server.api.embeddings import OpenAIEmbeddingRequest, TEIEmbedRequest
    from server.api.schemas import InferRequest, InferResponse, TokenizeRequest

    schema = create_app(Settings()).openapi()
    kinds = [InferRequest, InferResponse, OpenAIEmbeddingRequest, TEIEmbedRequest, TokenizeRequest]
    _, components = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    for name, component in components.items():
        assert schema["components"]["schemas"][name] == component, name
    body = schema["paths"]["/v1/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/InferRequest"}
    assert schema["components"]["schemas"]["InferRequest"]["required"] == ["inputs"]
    assert schema["paths"]["/v1/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/TokenizeRequest"}


def test_an_answers_writes_of_one_iteration_reach_the_socket_as_one():
    """`OneWriteTransport`: a head and a body written back to back go out in one write; a lone write
    goes out at the iteration's end; a close sends what is held first; the rest is the transport's."""
    from server.api.http_limits import OneWriteTransport

    class Recording:
        def __init__(self):
            self.calls = []

        def write(self, data):
            self.calls.append(("write", data))

        def close(self):
            self.calls.append(("close",))

        def is_closing(self):
            return False

    async def scenario():
        real = Recording()
        transport = OneWriteTransport(real, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert real.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert len(real.calls) == 1  # held until the iteration ends
        await asyncio.sleep(0)
        assert real.calls[1:] == [("write", b"HTTP/1.1 100 Continue\r\n\r\n")]
        transport.write(b"last")
        transport.close()
        assert real.calls[2:] == [("write", b"last"), ("close",)]
        await asyncio.sleep(0)
        assert len(real.calls) == 4 and transport.is_closing() is False

    asyncio.run(scenario())


def test_keep_alive_answers_come_whole_through_the_protocol(port):
    """Several requests on one connection, each answered whole and in order (head and body written
    together), then a HEAD request (a head alone) and the close."""
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    received = exchange(port, [request * 3 + b"HEAD / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"])
    answers = received.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 4 and all(a.startswith(b"200 OK") for a in answers)
    assert all(a.endswith(b"\r\n\r\nok") for a in answers[:3]) and answers[3].endswith(b"\r\n\r\n")
    assert b"connection: close" in answers[3]


def test_an_idle_kept_alive_connection_lasts_keep_alive_s_and_gets_no_408():
    """`keep_alive_s` is the idle time between requests (behind a proxy it must outlast the proxy's:
    deploy/README.md); the head deadline does not cut an idle connection, it starts at a head's first byte."""
    request = GET
    for keep_alive_s, idle_s, kept in ((30.0, 1.0, True), (0.3, 2.0, False)):
        server, _, port = serve(ok_app, keep_alive_s=keep_alive_s, header_timeout_s=0.3)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(request)
                assert sock.recv(4096).endswith(b"\r\n\r\nok")
                time.sleep(idle_s)  # idle past the head deadline (0.3 s) in both; past keep_alive_s in the second
                try:
                    sock.sendall(request)
                    answer = sock.recv(4096)
                except ConnectionError:  # sent into the closed connection: the peer reset it
                    answer = b""
                if kept:
                    assert answer.startswith(b"HTTP/1.1 200 ")  # not a 408
                else:
                    assert answer == b""  # closed by the server, nothing written (no 408 either)
        finally:
            server.should_exit = True


def test_a_request_sent_while_the_event_loop_was_busy_past_keep_alive_s_is_answered():
    """A kept-alive connection whose idle time ran out while the event loop was busy in an I/O
    callback (another connection's bytes: a burst, a CPU shared with other processes), its client's
    next request arriving meanwhile: the loop's next turn runs the overdue timer before it reads that
    request. uvicorn closed the connection with the request unread (the client's POST failed with a
    connection error; seen under 256 clients on 2 cores, 2026-11-30); it is answered now, and an idle
    connection still closes."""
    app = LoopHolder()
    server, thread, port = serve(app, keep_alive_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as kept:
            kept.sendall(GET)
            assert kept.recv(4096).endswith(b"\r\n\r\nok")  # its keep-alive time (0.3 s) starts
            app.hold(1.0)
            time.sleep(0.5)  # past keep_alive_s, the loop still busy
            kept.sendall(GET)  # the next request, unread until the loop is free
            try:
                answer = kept.recv(4096)
            except ConnectionError:
                answer = b""
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok"), answer
            time.sleep(1.0)  # idle past keep_alive_s, the loop free: closed as before
            assert kept.recv(4096) == b""
    finally:
        server.should_exit = True
        thread.join(30)
        app.close()


def test_a_request_sent_while_the_event_loop_was_busy_through_the_drain_grace_is_answered():
    """The stop (`shutdown`) gives an idle kept-alive connection IDLE_DRAIN_GRACE_S for a request its
    client already sent; with the event loop busy through the grace, the grace's timer runs before the
    loop reads that request: it is answered (with `Connection: close`), not reset."""
    app = LoopHolder()
    server, thread, port = serve(app)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as kept:
            kept.sendall(GET)
            assert kept.recv(4096).endswith(b"\r\n\r\nok")
            server.should_exit = True  # the stop: listener closed, then each connection's shutdown
            wait_until(lambda: not listening(port), "the listener to close")
            app.hold(2 * IDLE_DRAIN_GRACE_S + 0.5)
            time.sleep(IDLE_DRAIN_GRACE_S + 0.3)  # past the grace, the loop still busy
            kept.sendall(GET)  # sent before the connection was closed, unread until the loop is free
            try:
                answer = read_until_closed(kept)
            except ConnectionError:
                answer = b""
            assert answer.startswith(b"HTTP/1.1 200 ") and b"connection: close" in answer.lower(), answer
    finally:
        server.should_exit = True
        thread.join(30)
        app.close()


def test_a_head_begun_in_the_drain_grace_and_left_unfinished_still_meets_its_deadline():
    """A client that starts a request head in the stop's grace and never ends it: answered 408 at the
    head deadline and closed, so the stop ends (it waited for the connection for ever)."""
    server, thread, port = serve(ok_app, header_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as kept:
        kept.sendall(GET)
        assert kept.recv(4096).endswith(b"\r\n\r\nok")
        server.should_exit = True
        wait_until(lambda: not listening(port), "the listener to close")
        kept.sendall(b"GET / HTTP/1.1\r\nhost: ")  # in the grace, and never finished
        started = time.monotonic()
        answer = read_until_closed(kept)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 10


def test_a_served_request_leaves_no_reference_cycle():
    """uvicorn's request cycle holds its scope and tmod's protocol puts the cycle in the scope: the app
    unlinks them once the request is answered, so a request's objects go by reference counting and a
    worker under load leaves nothing to the garbage collector (issue 37: ~9 objects a request)."""
    import gc

    from server.api.app import TmodApp

    async def answer(body, request):
        return b'{"ok": true}', {}

    app = TmodApp()
    settings = Settings(port=free_port(), log_level="warning")
    app.configure(settings)
    app.fast_routes = {"/answer": answer}
    server = uvicorn.Server(uvicorn_config(app, settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the server to start")
    request = b"POST /answer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    try:
        exchange(settings.port, [request + b"POST /answer HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                                 b"content-length: 2\r\n\r\n{}"])  # the first request's objects made once
        gc.collect()
        gc.disable()
        try:
            received = exchange(settings.port, [request * 50 + b"GET /nothing HTTP/1.1\r\nhost: x\r\n"
                                                b"connection: close\r\n\r\n"])
            left = gc.collect()
        finally:
            gc.enable()
    finally:
        server.should_exit = True
        thread.join(30)
    assert received.count(b'HTTP/1.1 200 OK') == 50 and received.count(b'{"ok": true}') == 50
    assert left < 50  # before: over 450 (every request's cycle, scope, headers, event and more)


def test_a_kept_alive_connection_its_client_reset_ends_without_an_error(caplog):
    """A client that resets its kept-alive connection (SO_LINGER 0, as one that gives up does): the
    connection is lost with an error, and its idle timer, when it ran, read a closed socket
    (fileno -1: `ValueError`), logged as an asyncio callback's traceback (seen in a soak with clients
    giving up)."""
    caplog.set_level(logging.ERROR)
    server, thread, port = serve(ok_app, keep_alive_s=0.2)
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(GET)
            assert sock.recv(4096).endswith(b"\r\n\r\nok")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()  # a reset, not a close
        time.sleep(0.6)  # past keep_alive_s
        assert exchange(port, [GET.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")]).endswith(b"ok")
    finally:
        server.should_exit = True
        thread.join(30)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
