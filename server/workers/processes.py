"""The process `tmod-serve` starts, which becomes the engine process: `serve` (one process, or an
engine with `--workers N` HTTP worker processes kept running by `WorkerPool`), `serve_engines`
(`--engines N`), and the shared listener's stop at SIGTERM (`stop_taking_connections`)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

from server.config import STOP_SIGNALS, Settings
from server.logs import configure_logging
from server.ports import bind_port, http_url
from server.runtime import Runtime, cannot_serve
from server.temp_folders import ENGINE_SOCKET, make_private_folder, remove_private_folder
from server.workers.engine_service import EngineService
from server.workers.remote_runtime import run_worker

log = logging.getLogger("tmod.workers")

# ---- the shared listener at SIGTERM -------------------------------------------------------------------
SO_ATTACH_FILTER = 26  # Linux
# A classic BPF socket filter over a TCP segment (offset 0 is its TCP header): drop it when the SYN flag
# (byte 13, bit 0x02) is set, let every other segment through. On a listening socket: no new
# handshake starts (the client's SYN is retried, then refused once the socket is closed), while the
# handshakes under way complete and the connections already queued stay to be accepted.
NO_NEW_CONNECTIONS = ((0x30, 0, 0, 13), (0x45, 0, 1, 0x02), (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF))


def refuse_new_connections(listener: socket.socket) -> bool:
    """Attach `NO_NEW_CONNECTIONS` to a listening socket (every process holding it is affected).
    False where the system has no such filter (not Linux)."""
    import ctypes

    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in NO_NEW_CONNECTIONS))
    try:  # the kernel copies the program: the buffer may go once this returns
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                            struct.pack("HL", len(NO_NEW_CONNECTIONS), ctypes.addressof(program)))
    except OSError:
        return False
    return True


def queued_connections(listener: socket.socket) -> int:
    """Connections the kernel completed on a listening socket that no process has accepted yet (Linux
    `tcp_info.tcpi_unacked` of a listener)."""
    return struct.unpack_from("I", listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 24)[0]


async def stop_taking_connections(listener: socket.socket, timeout: float = 2.0, settle: float = 0.05) -> bool:
    """Refuse new connections and wait (at most `timeout`) until the workers have accepted every one
    queued, with `settle` seconds of an empty queue for handshakes under way. False: not supported."""
    if not refuse_new_connections(listener):
        return False
    deadline = time.monotonic() + timeout
    empty_since = None
    while time.monotonic() < deadline:
        if queued_connections(listener):
            empty_since = None
        elif empty_since is None:
            empty_since = time.monotonic()
        elif time.monotonic() - empty_since >= settle:
            return True
        await asyncio.sleep(0.005)
    log.warning("tmod-serve: %d connections still queued after %.1fs; stopping anyway", queued_connections(listener),
                timeout)
    return True


# ---- the process that starts it all (and becomes the engine) ------------------------------------------
class WorkerPool:
    RESTART_AFTER_S = 1.0  # a worker that keeps dying is restarted at most this often
    # A worker that dies this soon after its start, this many times in a row, will not start (it cannot
    # reach the engine's socket, say): the server stops, for its supervisor, instead of holding the port
    # with nobody to answer while it restarts workers every second
    EARLY_DEATH_S, GIVE_UP_AFTER = 10.0, 5

    def __init__(self, settings: Settings, engine_path: Path, listener: socket.socket):
        self.settings, self.engine_path, self.listener = settings, str(engine_path), listener
        # Workers are forked from a fresh interpreter (no threads of this process, no CUDA state) that
        # imported this module and the app once: a worker starts without importing torch again
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["server.workers.fork_server", __name__, "server.api.app",
                                             "server.api.http_limits"])
        self.processes: list = [None] * settings.workers
        self.started: list[float] = [0.0] * settings.workers
        self.early_deaths: list[int] = [0] * settings.workers  # in a row, each worker

    def start(self, index: int) -> None:
        process = self.context.Process(target=run_worker, name=f"tmod-worker-{index}",
                                       args=(self.settings, self.engine_path, self.listener, index))
        process.start()
        self.processes[index], self.started[index] = process, time.monotonic()

    def start_all(self) -> None:
        for index in range(len(self.processes)):
            self.start(index)

    def replace_dead(self) -> str | None:
        """Start a worker in place of each that died; or why the server stops instead (one keeps dying
        at start)."""
        for index, process in enumerate(self.processes):
            lived = time.monotonic() - self.started[index]
            if process.is_alive() or lived < self.RESTART_AFTER_S:
                continue
            self.early_deaths[index] = self.early_deaths[index] + 1 if lived < self.EARLY_DEATH_S else 0
            _forget_process(process.pid)
            if self.early_deaths[index] >= self.GIVE_UP_AFTER:
                return (f"HTTP worker {index} exited at start {self.early_deaths[index]} times in a row (the last with "
                        f"{exit_status(process.exitcode)}; the log says why)")
            log.error("worker %d (pid %d) exited with %s; starting another", index, process.pid,
                      exit_status(process.exitcode))
            self.start(index)
        return None

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each stops taking connections and finishes its requests), then wait."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker pid %d did not stop in %.0fs; killing it", process.pid, timeout)
                process.kill()
                process.join()
            _forget_process(process.pid)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.is_alive()]


def _forget_process(pid: int) -> None:
    """A gone process's live gauges leave the /metrics sums (its counters stay counted)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def serve(settings: Settings, index: int = 0, first_loaded=None) -> None:
    """`tmod-serve` with workers > 1, in the process that becomes the engine process (`index`: which
    engine of `serve_engines`, `first_loaded` their event that engine 0 is loaded: `_serve`)."""
    run_engine_loop(_serve(settings, index, first_loaded))


def run_engine_loop(main):
    """Run the engine process's event loop until `main` is done: uvloop where installed (a compiled
    loop, as the workers' uvicorn runs: each batch's timer, hand-off to the compute thread and back and
    answer write cost it less CPU than asyncio's loop in Python), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def serve_engines(settings: Settings) -> None:
    """`tmod-serve --engines N`: N engine processes, each `serve` with its own workers, on one port.
    This process holds the port (bound, never listening: it takes no connection), starts them, passes
    SIGTERM / SIGINT on (each drains as one server does) and exits non-zero if one of them did; one
    that stops on its own (a device failure) stops the others, for the supervisor to start afresh."""
    reserve = bind_port(settings.host, settings.port, reuse_port=True)
    port = reserve.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    context = multiprocessing.get_context("spawn")
    first_loaded, reasons = context.Event(), context.SimpleQueue()
    engines = [context.Process(target=run_engine, args=(settings, i, first_loaded, reasons), name=f"tmod-engine-{i}")
               for i in range(settings.engines)]
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    for engine in engines:
        engine.start()
    log.info("tmod-serve: %d engine processes (pids %s), %d HTTP workers each, on %s", len(engines),
             [e.pid for e in engines], settings.workers, http_url(settings.host, port))
    while not stop.wait(0.5):
        if any(not engine.is_alive() for engine in engines):
            log.error("tmod-serve: an engine process exited; stopping the others")
            break
    for engine in engines:
        if engine.is_alive():
            engine.terminate()  # SIGTERM: its workers finish their requests, then it drains
    for engine in engines:
        engine.join()
    reserve.close()
    failed = [e.exitcode for e in engines if e.exitcode not in (0, -signal.SIGTERM)]
    if failed:  # in the one line a single engine gives (server/cli.py), the first engine's to fail
        raise SystemExit(f"tmod-serve: {reasons.get()}" if not reasons.empty()
                         else f"tmod-serve: an engine process exited with {exit_status(failed[0])}")


def exit_status(code: int) -> str:
    """'code 1', or for a process a signal ended 'code -7 (SIGBUS)': the name says what happened."""
    try:
        return f"code {code} ({signal.Signals(-code).name})" if code < 0 else f"code {code}"
    except ValueError:
        return f"code {code}"


async def until_both_loaded(runtime: Runtime, first_loaded, stop: asyncio.Event) -> None:
    """Until this engine and engine 0 (`first_loaded`, set in its process) are loaded, or `stop`."""
    while not (stop.is_set() or (runtime.ready.is_set() and first_loaded.is_set())):
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def run_engine(settings: Settings, index: int, first_loaded, reasons) -> None:
    """Engine `index` of `serve_engines` (a spawned process): `serve`, exiting 1 where start-up or the
    device failed (as `tmod-serve` does), the reason put on `reasons` for the parent to say."""
    from server import runtime

    configure_logging(settings.log_level, settings.log_format)
    if not runtime.stop_with_parent():
        log.warning("engine %d (pid %d): tmod-serve is gone; not starting", index, os.getpid())
        raise SystemExit(1)
    runtime.on_device_failure = lambda: os.kill(os.getpid(), signal.SIGTERM)
    serve(settings, index, first_loaded)
    reason = runtime.exit_reason()
    if reason is not None:
        reasons.put(reason)
        raise SystemExit(1)


async def _serve(settings: Settings, index: int = 0, first_loaded=None) -> None:
    loop = asyncio.get_running_loop()
    folder = make_private_folder("engine")  # only this user reaches the engine
    engine_path = folder / ENGINE_SOCKET
    # bound before anything loads (a port in use fails at once); a further engine binds once loaded
    listener = listen(settings) if index == 0 else None
    runtime = Runtime(settings)
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:  # before start-up runs: a failed start-up stops the process by SIGTERM
        loop.add_signal_handler(sig, stop.set)
    # With `--engines N` the kernel hands each connection to any engine listening on the port, so /readyz
    # (answered by whichever) is true only while every listening engine is loaded or none is. Engine 0
    # listens at once (/healthz answers through a long start-up such as CUDA graphs' capture, /readyz says
    # "loading") and sets `first_loaded` once loaded; a further engine joins the port once it is loaded
    # and engine 0 is: it never answers 503 not_ready while a loaded engine's /readyz says ready.
    service = EngineService(runtime, first_loaded.set if first_loaded is not None and index == 0 else None)
    await service.start(engine_path)
    if first_loaded is not None and index > 0:
        await until_both_loaded(runtime, first_loaded, stop)
    if not stop.is_set():  # (stopped, or start-up failed, before it joined the port: no workers to stop)
        await _serve_port(settings, engine_path, listener if listener is not None else listen(settings), stop)
    elif listener is not None:
        listener.close()
    await service.stop()
    await runtime.shutdown()
    remove_private_folder(folder)
    log.info("tmod-serve: stopped")


def listen(settings: Settings) -> socket.socket:
    listener = bind_port(settings.host, settings.port, reuse_port=settings.engines > 1)  # (`serve_engines`)
    listener.listen(2048)
    return listener


async def _serve_port(settings: Settings, engine_path: Path, listener: socket.socket, stop: asyncio.Event) -> None:
    """This engine's HTTP workers on `listener` until `stop`; then they drain."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(settings, engine_path, listener)
    pool.start_all()
    host, port = listener.getsockname()[:2]
    log.info("tmod-serve: engine process %d, %d HTTP workers (pids %s) on %s", os.getpid(),
             settings.workers, pool.pids(), http_url(host, port))
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            reason = pool.replace_dead()
            if reason is not None:
                log.critical("tmod-serve: %s; stopping", reason)
                cannot_serve(reason)
                break
    log.info("tmod-serve: stopping; the workers finish their requests first")
    # New connections refused, and those the kernel already queued on the listener accepted by the
    # workers, before any of them stops: a socket closed with connections queued resets them (a
    # client that reconnected after a `Connection: close` answer lost its request, issue 37)
    if await stop_taking_connections(listener):
        await loop.run_in_executor(None, pool.stop, settings.request_timeout_s + 5)
        listener.close()
    else:  # no socket filter here: this copy goes first, the workers' close ends the listener
        listener.close()
        await loop.run_in_executor(None, pool.stop, settings.request_timeout_s + 5)
