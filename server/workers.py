"""`tmod-serve --workers N`: N HTTP worker processes feed one engine process that owns the device.

The split is vLLM's (API server / engine core). Each worker runs the whole HTTP app (`server/app.py`:
FastAPI, JSON, validation, tokenization, decode) over a `RemoteRuntime`; the engine process (the
one `tmod-serve` started) runs the `Runtime` (backbone, modules, batcher, model runner) and an
`EngineService` that takes every worker's requests, so one batch forms across workers. The workers
share one listening socket (the kernel hands each connection to one of them); the engine process
starts another worker when one dies, and on SIGTERM stops the workers (each finishes its requests)
before it drains its queue and exits.

Measured why (bench/bench_frontend.py): one process spends ~1 ms of CPU per 1-input request on HTTP,
JSON, tokenization and decode, which caps it near 1,000 requests/s whatever the device computes.

Between the processes of one server, over a Unix socket in a folder only this user can open,
messages are tuples; the messages one side has ready in one event-loop iteration go as one frame
(`Outbox`: a pickled list, prefixed by its length in 4 bytes), so under load one frame carries many
requests or answers:
  engine -> worker  ("state", EngineState) on connect and after every change (ready, modules);
                    ("ok", id, value) or ("error", id, status, type, message, details) per request
  worker -> engine  ("infer", id, PackedRows, tasks, seconds left), ("cancel", id) or
                    ("manage", id, task, action, version)
Requests and answers are arrays, not objects per input: a request's inputs go as one token array
(ids, type ids, segments, words, offsets, casing classes: `PackedRows`, made by the worker's
tokenizer) that the engine only slices and collates; an answer to "infer" holds one array per task
with every input's logits (`pack_answers`; token tasks: each input's own tokens one after the
other) for the worker to decode (`decode_rows`), or the decoded answers of a task served through a
bridge (its logits lie on a tokenization only the engine has).

Backpressure and cancellation: a worker keeps at most `in_flight_limit` requests in the engine and
answers 429 beyond that (the engine refuses the same way a worker that sends more); a request whose
client left (asked once it has waited `DISCONNECT_CHECK_AFTER`, then every `WATCH_EVERY`) is
cancelled in the engine ("cancel"), so a batch that has not started yet drops it (no device work).
A deadline travels with the request and the engine's batcher drops a job past it before compute.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from modules_store import Manifest, TaskType
from server.backbone import EncodedInput
from server.backbone.tokens import PackedRows, TextEncoder, plain_rows
from server.batcher import ClientGone, Job
from server.config import Settings
from server.errors import ApiError
from server.heads.decode import decode_rows
from server.logs import configure_logging
from server.metrics import Metrics
from server.runtime import Runtime, one_host_thread

log = logging.getLogger("tmod.workers")

FRAME = struct.Struct("!I")
DISCONNECT_CHECK_AFTER = 0.05  # seconds a request waits before its client is asked whether it is still there
WATCH_EVERY = 0.1  # seconds between two such questions to a waiting request


def in_flight_limit(settings: Settings) -> int:
    """Requests one worker may have in the engine at once: its share of the engine's queue."""
    return max(1, -(-settings.max_queue // max(1, settings.workers)))


@dataclass
class PackedAnswers:
    """A request's answers: per task one float32 array, all of them in one buffer (`layout`: task and
    shape, in order); tasks the engine decoded itself (served through a bridge) in `decoded`."""

    layout: list[tuple[str, tuple[int, ...]]]
    data: bytes
    decoded: dict[str, list]

    def arrays(self) -> dict[str, object]:
        out, offset = dict(self.decoded), 0
        flat = np.frombuffer(self.data, dtype=np.float32).copy()  # writable: torch.from_numpy reads it in decode
        for task, shape in self.layout:
            count = int(np.prod(shape))
            out[task] = flat[offset:offset + count].reshape(shape)
            offset += count
        return out


def pack_answers(results: list[dict]) -> PackedAnswers:
    """A request's answers (per input, per task: the row's logits from `row_logits`) -> per task one
    array: (inputs, labels), or for a token task every input's (tokens, labels) one after the other."""
    layout, parts, decoded = [], [], {}
    for task in results[0]:
        answers = [row[task] for row in results]
        if not isinstance(answers[0], np.ndarray):
            decoded[task] = answers
            continue
        if len(answers) == 1:
            array = answers[0] if answers[0].ndim == 2 else answers[0][None]
        else:  # a token task's rows are (tokens, labels) each; a sequence task's (labels,)
            array = np.concatenate(answers) if answers[0].ndim == 2 else np.stack(answers)
        layout.append((task, array.shape))
        parts.append(array.astype(np.float32, copy=False).tobytes())
    return PackedAnswers(layout, b"".join(parts), decoded)


def unpack_rows(packed: np.ndarray, lengths: list[int], token_task: bool) -> list[np.ndarray]:
    """`pack_answers`' array for one task -> one array per input: (labels,) each, or for a token
    task (tokens, labels) each, `lengths` the inputs' token counts."""
    if not token_task:
        return list(packed)
    return np.split(packed, np.cumsum(lengths)[:-1])


async def read_frame(reader: asyncio.StreamReader) -> list:
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return pickle.loads(await reader.readexactly(size))


class Outbox:
    """Messages to one peer. The first message of an event-loop iteration schedules a flush at its
    end, so what is ready together goes as one frame: one pickle and one write for all of it
    (each frame cost the engine process a read, an unpickle and a write: bench/bench_frontend.py)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.pending: list = []

    def send(self, message) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(message)

    def flush(self) -> None:
        messages, self.pending = self.pending, []
        if messages and not self.writer.is_closing():
            data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
            self.writer.write(FRAME.pack(len(data)) + data)


@dataclass
class ModuleView:
    """What a worker knows of a loaded module: enough to check a request, decode and describe it."""

    task: str
    version: str
    manifest: Manifest
    bridge: str | None
    info: dict  # what /v1/tasks says of it (Runtime.describe)


@dataclass
class EngineState:
    ready: bool
    startup_error: str | None
    model: tuple[str, str] | None  # (backbone name, fingerprint short form), once loaded
    modules: dict[str, ModuleView] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    text: TextEncoder | None = None  # the tokenizer: sent once per worker, in its first ready state


# ---- the engine process ------------------------------------------------------------------------------
def error_reply(ident: int, exc: Exception, kind: str) -> tuple:
    """What a worker gets for a request the engine could not answer: its ApiError, or a 500."""
    if isinstance(exc, ApiError):
        return ("error", ident, exc.status, exc.type, exc.message, exc.details)
    log.error("engine: %s failed", kind, exc_info=exc)
    return ("error", ident, 500, "internal_error", f"{type(exc).__name__}: {exc}", {})


class EngineService:
    """Serves one Runtime to the worker processes' connections."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.peers: dict[Outbox, bool] = {}  # a worker's connection -> its tokenizer was sent
        self.jobs: dict[Outbox, dict[int, Job]] = {}  # per worker, its requests in the engine by id (for "cancel")
        self.limit = in_flight_limit(runtime.settings)
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, path: Path) -> None:
        await self.runtime.open()
        self.server = await asyncio.start_unix_server(self._serve_peer, path=str(path))
        self._keep(self._announce_when_loaded())

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for peer in list(self.peers):
            peer.writer.close()

    def _keep(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _announce_when_loaded(self) -> None:
        while not (self.runtime.ready.is_set() or self.runtime.startup_error):
            await asyncio.sleep(0.05)
        self.broadcast()

    def state(self) -> EngineState:
        rt = self.runtime
        ready = rt.ready.is_set()
        return EngineState(
            ready=ready, startup_error=rt.startup_error, model=rt.model_info() if ready else None,
            modules={task: self.view(m) for task, m in rt.modules.items()}, load_errors=dict(rt.load_errors),
        )

    def view(self, module) -> ModuleView:
        return ModuleView(module.task, module.version, module.manifest, module.bridge, self.runtime.describe(module))

    def broadcast(self) -> None:
        state = self.state()
        for peer in list(self.peers):
            self._send_state(peer, state)

    def _send_state(self, peer: Outbox, state: EngineState) -> None:
        if state.ready and not self.peers.get(peer):
            state = replace(state, text=self.runtime.backbone.text)
            self.peers[peer] = True
        peer.send(("state", state))
        peer.flush()  # at once: an answer sent after it must not overtake it

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Outbox(writer)
        self.peers[peer] = False
        self.jobs[peer] = {}
        self._send_state(peer, self.state())
        try:
            while True:
                try:
                    messages = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break  # the worker exited; answers still being computed for it are dropped
                for message in messages:
                    if message[0] == "infer":
                        self._infer(peer, *message[1:])
                    elif message[0] == "cancel":
                        self._cancel(peer, message[1])
                    else:
                        self._keep(self._answer(peer, message))
        finally:
            self.peers.pop(peer, None)
            for ident in list(self.jobs.get(peer, ())):  # the worker is gone: so are its requests
                self._cancel(peer, ident)
            self.jobs.pop(peer, None)
            writer.close()

    def _cancel(self, peer: Outbox, ident: int) -> None:
        """A worker's request whose client left: a batch that has not started drops it."""
        job = self.jobs.get(peer, {}).pop(ident, None)
        if job is not None and job.future is not None and not job.future.done():
            job.future.set_exception(ClientGone("client disconnected"))
            self.runtime.metrics.dropped.labels("client_gone").inc()

    async def _answer(self, peer: Outbox, message) -> None:
        kind, ident, *args = message
        try:
            if kind == "manage":
                reply = ("ok", ident, await self._manage(*args))
            else:
                raise ApiError(500, "internal_error", f"the engine got an unknown message {kind!r}")
        except Exception as exc:  # the engine stays up; the request gets what went wrong
            reply = error_reply(ident, exc, kind)
        peer.send(reply)

    def _infer(self, peer: Outbox, ident: int, packed: PackedRows, tasks: list[str], seconds_left: float) -> None:
        """Queue a worker's request; `_infer_done` answers it when its batch has run. No task per
        request: a callback is a fraction of a task's cost, which the engine process pays per request."""
        loaded = self.runtime.modules  # one snapshot: the worker's view may be a change behind
        waiting = self.jobs.setdefault(peer, {})
        try:
            unknown = [t for t in tasks if t not in loaded]
            if unknown:
                raise ApiError(400, "unknown_task", f"unknown task(s) {unknown}; loaded tasks: {sorted(loaded)}",
                               loaded_tasks=sorted(loaded))
            if len(waiting) >= self.limit:
                raise ApiError(429, "overloaded", f"server overloaded: {self.limit} requests of this worker in "
                                                  "flight; retry later")
            job = Job(rows=packed.rows(), modules={t: loaded[t] for t in tasks},
                      deadline=time.perf_counter() + seconds_left)
            future = self.runtime.enqueue(job)
        except Exception as exc:
            peer.send(error_reply(ident, exc, "infer"))
            return
        waiting[ident] = job
        future.add_done_callback(functools.partial(self._infer_done, peer, ident, job))

    def _infer_done(self, peer: Outbox, ident: int, job: Job, future: asyncio.Future) -> None:
        self.jobs.get(peer, {}).pop(ident, None)
        try:
            results = future.result()
            t = job.timings
            versions = {task: m.version for task, m in job.modules.items()}
            reply = ("ok", ident, (pack_answers(results), versions, (t.extra.get("queue", 0.0), t.backbone, t.heads)))
        except Exception as exc:
            reply = error_reply(ident, self.runtime.refusal(exc), "infer")
        peer.send(reply)

    async def _manage(self, task: str, action: str, version: str | None):
        module, previous = await self.runtime.manage(task, action, version)
        self.broadcast()  # every worker has the new set before this answer reaches the one that asked
        return self.view(module), previous


# ---- a worker process ---------------------------------------------------------------------------------
class RemoteRuntime:
    """The Runtime interface the app uses (`server/runtime.py`), in a worker process: tokenization
    and decode here, everything else by asking the engine process."""

    def __init__(self, settings: Settings, path: str | Path):
        self.settings = settings
        self.path = str(path)
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self.modules: dict[str, ModuleView] = {}
        self.load_errors: dict[str, str] = {}
        self.text: TextEncoder | None = None
        self._model: tuple[str, str] | None = None
        self._seen: dict[tuple[str, str], ModuleView] = {}  # (task, version) -> view, for answers of a replaced version
        self.tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tmod-tokenize")
        self._pending: dict[int, asyncio.Future] = {}
        self._waiting: dict[int, Job] = {}  # inference requests in the engine, watched for clients that left
        self.limit = in_flight_limit(settings)
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._listener: asyncio.Task | None = None
        self._gone: ApiError | None = None

    async def open(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._outbox = Outbox(self._writer)
        self._informed = asyncio.Event()
        self._listener = asyncio.get_running_loop().create_task(self._listen(reader))
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        await self._informed.wait()  # the engine's state arrives first: /readyz never answers from a blank view
        if self._gone is not None:  # the engine died before it said anything: this worker cannot start
            raise RuntimeError("the engine process closed its connection during start-up")
        gc.freeze()  # start-up's objects (libraries, app) out of the collector's passes, as in Runtime.start

    async def shutdown(self) -> None:
        # uvicorn has answered this worker's requests by now
        if self._listener is not None:
            self._listener.cancel()
            self._watcher.cancel()
        if self._writer is not None:
            self._writer.close()
        self.tokenize_executor.shutdown(wait=True)

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                for message in await read_frame(reader):
                    self._receive(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._gone = ApiError(503, "engine_unavailable", "the engine process is gone; retry later")
            self.ready.clear()
            self.startup_error = "the engine process is gone"
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self._gone)
            self._pending.clear()
            self._informed.set()  # an `open` still waiting for the first state gives up
            log.error("worker %d: the engine process closed its connection; stopping", os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop: nothing is left to serve

    def _receive(self, message) -> None:
        if message[0] == "state":
            self._apply(message[1])
            return
        future = self._pending.pop(message[1], None)
        if future is None or future.done():
            return
        if message[0] == "ok":
            future.set_result(message[2])
        else:
            _, _, status, type_, text, details = message
            future.set_exception(ApiError(status, type_, text, **details))

    def _apply(self, state: EngineState) -> None:
        if state.text is not None:
            self.text = state.text
        self._model = state.model
        self.startup_error = state.startup_error
        self.load_errors = state.load_errors
        self.modules = state.modules  # replaced whole: requests keep the snapshot they took
        self._seen.update({(v.task, v.version): v for v in state.modules.values()})
        self.metrics.modules_loaded.set(len(state.modules))
        if state.ready and self.text is not None:
            self.ready.set()
        else:
            self.ready.clear()
        self._informed.set()

    async def _ask(self, kind: str, *args, job: Job | None = None):
        if self._gone is not None:
            raise self._gone
        ident = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        if job is not None:
            self._waiting[ident] = job
        self._outbox.send((kind, ident, *args))
        try:
            return await future
        finally:
            self._waiting.pop(ident, None)

    async def _watch(self) -> None:
        """Requests whose client left are cancelled in the engine (and answered 499 here)."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            ask_before = time.perf_counter() - DISCONNECT_CHECK_AFTER
            for ident, job in list(self._waiting.items()):
                if job.enqueued < ask_before and job.is_disconnected is not None and await job.is_disconnected():
                    future = self._pending.pop(ident, None)
                    if future is not None and not future.done():
                        future.set_exception(ApiError(499, "client_closed_request", "client disconnected"))
                        self._outbox.send(("cancel", ident))

    # ---- the interface the app uses (as Runtime's) ------------------------------------------------
    def model_info(self) -> tuple[str, str]:
        return self._model

    def encode(self, texts, text_pairs, truncate: bool, max_tokens: int | None) -> list[EncodedInput]:
        return self.text.encode(texts, text_pairs, truncate, max_tokens)

    def describe(self, module: ModuleView) -> dict:
        return module.info

    async def submit(self, job: Job) -> list[dict]:
        if len(self._pending) >= self.limit:
            raise ApiError(429, "overloaded", f"server overloaded: {self.limit} requests of this worker in flight; "
                                              "retry later")
        packed, versions, (queue, backbone, heads) = await self._ask(
            "infer", PackedRows.of(job.rows), list(job.modules), job.deadline - time.perf_counter(), job=job)
        job.modules = {task: self._seen.get((task, v), job.modules[task]) for task, v in versions.items()}
        job.timings.extra["queue"], job.timings.backbone, job.timings.heads = queue, backbone, heads
        return self._decode(job, packed.arrays())

    def _decode(self, job: Job, packed: dict[str, object]) -> list[dict]:
        """Each task's packed logits -> answers, over the job's rows collated (answers already
        decoded by the engine, those of bridged tasks, are taken as they are)."""
        results: list[dict] = [{} for _ in job.rows]
        batch = None
        plain = plain_rows(job.rows)  # windows of a longer text keep their logits (server/windows.py)
        for task, module in job.modules.items():
            answers = packed[task]
            if not isinstance(answers, np.ndarray):
                for row, answer in zip(results, answers):
                    row[task] = answer
                continue
            if len(plain) < len(job.rows):  # windows of a longer text keep their logits (server/windows.py)
                token_task = module.manifest.task_type == TaskType.token_classification
                rows = unpack_rows(answers, [len(row) for row in job.rows], token_task)
                for r, row in enumerate(rows):
                    results[r][task] = row
                if not plain:
                    continue
                answers = np.concatenate([rows[r] for r in plain]) if token_task else np.stack([rows[r] for r in plain])
            batch = batch or self.text.collate([job.rows[r] for r in plain], device="cpu")
            answers = decode_rows(module.manifest.task_type, module.manifest.labels, answers, batch,
                                  [job.rows[r].answer for r in plain], module.manifest.decoding)
            for r, answer in zip(plain, answers):
                results[r][task] = answer
        return results

    async def manage(self, task: str, action: str, version: str | None) -> tuple[ModuleView, str | None]:
        return await self._ask("manage", task, action, version)


def run_worker(settings: Settings, engine_path: str, listener: socket.socket, index: int) -> None:
    """A worker process: the HTTP app over a RemoteRuntime, on the shared listening socket."""
    from server.app import create_app
    from server.http_limits import DrainingServer, uvicorn_config

    configure_logging(settings.log_level)
    one_host_thread()  # decode's small tensors, one request's token lists: the cores belong to the others
    app = create_app(settings, runtime=RemoteRuntime(settings, engine_path))
    config = uvicorn_config(app, settings)
    log.info("worker %d (pid %d) serving", index, os.getpid())
    DrainingServer(config).run(sockets=[listener])


# ---- the process that starts it all (and becomes the engine) ------------------------------------------
class WorkerPool:
    RESTART_AFTER_S = 1.0  # a worker that keeps dying is restarted at most this often

    def __init__(self, settings: Settings, engine_path: Path, listener: socket.socket):
        self.settings, self.engine_path, self.listener = settings, str(engine_path), listener
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or CUDA state
        self.processes: list = [None] * settings.workers
        self.started: list[float] = [0.0] * settings.workers

    def start(self, index: int) -> None:
        process = self.context.Process(target=run_worker, name=f"tmod-worker-{index}",
                                       args=(self.settings, self.engine_path, self.listener, index))
        process.start()
        self.processes[index], self.started[index] = process, time.monotonic()

    def start_all(self) -> None:
        for index in range(len(self.processes)):
            self.start(index)

    def replace_dead(self) -> None:
        for index, process in enumerate(self.processes):
            if process.is_alive() or time.monotonic() - self.started[index] < self.RESTART_AFTER_S:
                continue
            log.error("worker %d (pid %d) exited with code %s; starting another", index, process.pid, process.exitcode)
            _forget_process(process.pid)
            self.start(index)

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


def serve(settings: Settings) -> None:
    """`tmod-serve` with workers > 1, in the process that becomes the engine process."""
    asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> None:
    loop = asyncio.get_running_loop()
    folder = Path(tempfile.mkdtemp(prefix="tmod-engine-"))  # mode 0700: only this user reaches the engine
    engine_path = folder / "engine.sock"
    listener = socket.create_server((settings.host, settings.port), backlog=2048)
    runtime = Runtime(settings)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start-up runs: a failed start-up stops the process by SIGTERM
        loop.add_signal_handler(sig, stop.set)
    service = EngineService(runtime)
    await service.start(engine_path)
    pool = WorkerPool(settings, engine_path, listener)
    pool.start_all()
    host, port = listener.getsockname()[:2]
    log.info("tmod-serve: engine process %d, %d HTTP workers (pids %s) on http://%s:%d", os.getpid(),
             settings.workers, pool.pids(), host, port)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pool.replace_dead()
    log.info("tmod-serve: stopping; the workers finish their requests first")
    # this process's copy of the listening socket goes first: held open while the workers stop, the
    # kernel would go on accepting connections that no one reads, reset (requests lost) at its close
    listener.close()
    await loop.run_in_executor(None, pool.stop, settings.request_timeout_s + 5)
    await service.stop()
    await runtime.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    log.info("tmod-serve: stopped")
