"""A worker process's side of `--workers N`: `RemoteRuntime`, the `Runtime` interface the whole HTTP
app (server/api/app.py: validation, tokenization, decode) runs over, forwarding each request's rows to the
engine process in frames (`WorkerOutbox`) and decoding the answers that come back; `run_worker`, the
worker process itself (uvicorn on the shared socket, server/api/http_limits.py's drain)."""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from modules_store import TaskType
from server.backbone import EncodedInput
from server.backbone.tokens import TextEncoder, plain_rows
from server.batcher import Job
from server.config import Settings
from server.errors import ApiError
from server.heads.decode import decode_rows
from server.logs import configure_logging
from server.metrics import Metrics, MetricsFolderFull
from server.runtime import name_os_thread, one_host_thread, stop_with_parent
from server.workers.frames import (ANSWERS, ENGINE_SILENT_S, EngineState, ModuleView, control_frame, in_flight_limit,
                                   read_answers, read_frame, request_frame, unpack_rows, write_frame)

log = logging.getLogger("tmod.workers")

DISCONNECT_CHECK_AFTER = 0.05  # seconds a request waits before its client is asked whether it is still there
WATCH_EVERY = 0.1  # seconds between two such questions to a waiting request
YOUNG_COLLECTION_EVERY = 20_000  # a worker's garbage collector: container allocations between young collections


class WorkerOutbox:
    """What a worker sends in one event-loop iteration: its first message schedules a flush at the
    iteration's end, which writes one control frame (if any) and one request frame. `failed(ids,
    exc)`: requests that could not be written."""

    def __init__(self, writer: asyncio.StreamWriter, failed):
        self.writer, self.failed = writer, failed
        self.requests: list[tuple] = []
        self.cancels: list[int] = []
        self.messages: list = []

    def _soon(self) -> None:
        if not (self.requests or self.cancels or self.messages):
            asyncio.get_running_loop().call_soon(self.flush)

    def request(self, ident: int, rows, tasks: str, seconds_left: float) -> None:
        self._soon()
        self.requests.append((ident, rows, tasks, seconds_left))

    def cancel(self, ident: int) -> None:
        self._soon()
        self.cancels.append(ident)

    def send(self, message) -> None:
        self._soon()
        self.messages.append(message)

    def flush(self) -> None:
        requests, cancels, messages = self.requests, self.cancels, self.messages
        self.requests, self.cancels, self.messages = [], [], []
        if self.writer.is_closing():
            return
        if messages:
            write_frame(self.writer, control_frame(messages))
        if requests or cancels:
            try:
                parts = request_frame(requests, cancels)
            except Exception as exc:  # never leave the requests waiting for an answer that cannot come
                log.exception("worker %d: a request frame could not be made", os.getpid())
                self.failed([ident for ident, *_ in requests], exc)
                return
            write_frame(self.writer, parts)


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
        self.skipped: dict[str, str] = {}
        self.text: TextEncoder | None = None
        self._model: tuple[str, str] | None = None
        self._modules_of: dict[str, str] | None = None
        self._seen: dict[tuple[str, str], ModuleView] = {}  # (task, version) -> view, for answers of a replaced version
        self.tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tmod-tokenize",
                                                    initializer=name_os_thread)
        self._pending: dict[int, asyncio.Future] = {}
        self._waiting: dict[int, Job] = {}  # inference requests in the engine, watched for clients that left
        self.limit = in_flight_limit(settings)
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._listener: asyncio.Task | None = None
        self._gone: ApiError | None = None
        self._heard = time.monotonic()  # when the engine's last frame came (it sends one every HEARTBEAT_S)
        self._silence_reason: str | None = None  # while the engine says nothing: why (`_silent`)

    async def open(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._outbox = WorkerOutbox(self._writer, self._fail)
        self._informed = asyncio.Event()
        self._listener = asyncio.get_running_loop().create_task(self._listen(reader))
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        await self._informed.wait()  # the engine's state arrives first: /readyz never answers from a blank view
        if self._gone is not None:  # the engine died before it said anything: this worker cannot start
            raise RuntimeError("the engine process closed its connection during start-up")
        gc.freeze()  # start-up's objects (libraries, app) out of the collector's passes, as in Runtime.start
        # a young collection walks every container still alive, and a worker's in-flight requests are many:
        # at the default 700 allocations it ran every few requests, over the same live objects each time
        gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])

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
                body = await read_frame(reader)
                self._heard = time.monotonic()
                if self._silence_reason is not None:
                    log.warning("worker %d: the engine process answers again", os.getpid())
                    self._silence_reason = None
                if body[:1] == ANSWERS:
                    self._answers(body)
                else:
                    for message in pickle.loads(memoryview(body)[1:]):
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

    def _answers(self, body: bytes) -> None:
        """An answer frame: every request in it decoded together (`_decode_frame`), then answered."""
        pending, waiting = self._pending, self._waiting
        answered = []  # (future, job, arrays) of the requests to decode
        for ident, answer in read_answers(body):
            future = pending.pop(ident, None)
            if future is None or future.done():
                continue
            if isinstance(answer, ApiError):
                future.set_exception(answer)
                continue
            arrays, versions, (queue, backbone, heads) = answer
            job = waiting[ident]
            # the versions that answered, in the order the request named its tasks (its answers' order)
            job.modules = {task: self._seen.get((task, versions[task]), module) for task, module in job.modules.items()
                           if task in versions}
            job.timings.extra["queue"], job.timings.backbone, job.timings.heads = queue, backbone, heads
            answered.append((future, job, arrays))
        for future, results in zip([a[0] for a in answered], self._decode_frame([a[1:] for a in answered])):
            if isinstance(results, Exception):
                future.set_exception(results)
            else:
                future.set_result(results)

    def _fail(self, idents: list[int], exc: Exception) -> None:
        for ident in idents:
            future = self._pending.pop(ident, None)
            if future is not None and not future.done():
                future.set_exception(ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}"))

    def _receive(self, message) -> None:
        if message[0] == "state":
            self._apply(message[1])
            return
        if message[0] == "alive":  # the heartbeat: hearing it was the point
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
        self._model, self._modules_of = state.model, state.modules_of
        self.startup_error = state.startup_error
        self.load_errors, self.skipped = state.load_errors, state.skipped
        self.modules = state.modules  # replaced whole: requests keep the snapshot they took
        self._seen.update({(v.task, v.version): v for v in state.modules.values()})
        self.metrics.modules_loaded.set(len(state.modules))
        if state.ready and self.text is not None:
            self.ready.set()
        else:
            self.ready.clear()
        self._informed.set()

    def _future(self) -> tuple[int, asyncio.Future]:
        if self._gone is not None:
            raise self._gone
        if self._silence_reason is not None:
            raise self.silence()
        ident = next(self._ids) & 0x7FFFFFFF  # an int32 on the wire
        future = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        return ident, future

    async def _watch(self) -> None:
        """Requests whose client left are cancelled in the engine (and answered 499 here); an engine
        silent past ENGINE_SILENT_S is taken for stopped or stuck (`_silent`)."""
        looked = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_EVERY)
            now = time.monotonic()
            # after a turn this worker's own loop was held up, its reader goes first: what the engine
            # sent meanwhile is still unread
            held_up, looked = now - looked > 1.0, now
            if self._silence_reason is None and now - self._heard > ENGINE_SILENT_S and not held_up:
                self._silent()
            ask_before = time.perf_counter() - DISCONNECT_CHECK_AFTER
            for ident, job in list(self._waiting.items()):
                if job.enqueued < ask_before and job.is_disconnected is not None and await job.is_disconnected():
                    self._give_up(ident, ApiError(499, "client_closed_request", "client disconnected"))

    def _give_up(self, ident: int, error: ApiError) -> None:
        """A request this worker answers itself (with `error`), cancelled in the engine."""
        future = self._pending.pop(ident, None)
        if future is not None and not future.done():
            future.set_exception(error)
            self._outbox.cancel(ident)

    def _silent(self) -> None:
        """The engine process said nothing for ENGINE_SILENT_S (stopped, or its event loop stuck): its
        requests here are answered 503 (cancelled there, should it come back), and so is every new one
        and the health routes, until it is heard again. They waited for ever, and /healthz said ok."""
        silent_s = time.monotonic() - self._heard
        self._silence_reason = (f"the engine process has sent nothing for {silent_s:.0f} s (stopped or stuck); "
                                "retry later")
        log.error("worker %d: %s", os.getpid(), self._silence_reason)
        for ident in list(self._waiting):
            self._give_up(ident, self.silence())

    def silence(self) -> ApiError | None:
        """The 503 while the engine process says nothing, else None (a new error each time: one raised
        again and again would grow its traceback)."""
        reason = self._silence_reason
        return None if reason is None else ApiError(503, "engine_unresponsive", reason)

    # ---- the interface the app uses (as Runtime's) ------------------------------------------------
    def model_info(self) -> tuple[str, str]:
        return self._model

    def modules_of(self) -> dict[str, str]:
        return self._modules_of

    def encode(self, texts, text_pairs, truncate: bool, max_tokens: int | None) -> list[EncodedInput]:
        return self.text.encode(texts, text_pairs, truncate, max_tokens)

    def describe(self, module: ModuleView) -> dict:
        return module.info

    async def submit(self, job: Job) -> list[dict]:
        if len(self._pending) >= self.limit:
            raise ApiError(429, "overloaded", f"server overloaded: {self.limit} requests of this worker in flight; "
                                              "retry later")
        ident, future = self._future()
        self._waiting[ident] = job
        self._outbox.request(ident, job.rows, ",".join(job.modules), job.deadline - time.perf_counter())
        try:
            return await future  # decoded, with the job's modules and timings set (`_answers`)
        finally:
            self._waiting.pop(ident, None)

    def _decode_frame(self, answered: list[tuple[Job, dict]]) -> list[list[dict] | Exception]:
        """The requests of one answer frame, `(job, packed logits by task)` each -> each one's answers
        (or the exception its decode raised). Decoded together, one `decode_rows` per module over every
        request's rows, as the one process decodes a batch: its numpy calls are paid once per frame,
        not once per request. A request read in windows (server/windows.py) is decoded on its own."""
        out: list = [None] * len(answered)
        groups: dict[int, tuple[str, object, list]] = {}  # id(module) -> (task, module, [(request, packed)])
        for i, (job, packed) in enumerate(answered):
            if len(plain_rows(job.rows)) < len(job.rows):
                out[i] = self._decode_alone(job, packed)
                continue
            out[i] = [dict.fromkeys(job.modules) for _ in job.rows]  # each answer's tasks in the request's order
            for task, module in job.modules.items():
                answers = packed[task]
                if not isinstance(answers, np.ndarray):  # decoded by the engine (a bridged task)
                    for row, answer in zip(out[i], answers):
                        row[task] = answer
                    continue
                groups.setdefault(id(module), (task, module, []))[2].append((i, answers))
        for task, module, members in groups.values():
            rows = [row for i, _ in members for row in answered[i][0].rows]
            values = members[0][1] if len(members) == 1 else np.concatenate([answers for _, answers in members])
            try:
                answers = decode_rows(module.manifest.task_type, module.manifest.labels, values, rows,
                                      [row.answer for row in rows], module.manifest.decoding)
            except Exception:  # noqa: BLE001 - each request alone: only the one that fails gets its error
                for i, _ in members:
                    if not isinstance(out[i], Exception):
                        out[i] = self._decode_alone(answered[i][0], {task: answered[i][1][task]}, out[i])
                continue
            at = 0
            for i, _ in members:
                if isinstance(out[i], Exception):
                    at += len(answered[i][0].rows)
                    continue
                for result in out[i]:
                    result[task] = answers[at]
                    at += 1
        return out

    def _decode_alone(self, job: Job, packed: dict[str, object], results: list[dict] | None = None
                      ) -> list[dict] | Exception:
        try:
            return self._decode(job, packed, results)
        except Exception as exc:  # noqa: BLE001 - this request's answer is its error (a 500)
            log.error("worker %d: decoding a request failed", os.getpid(), exc_info=exc)
            return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}")

    def _decode(self, job: Job, packed: dict[str, object], results: list[dict] | None = None) -> list[dict]:
        """Each task's packed logits -> answers, over the job's rows (answers already decoded by the
        engine, those of bridged tasks, are taken as they are), into `results` (one dict per row)."""
        results = results if results is not None else [{} for _ in job.rows]
        plain = plain_rows(job.rows)  # windows of a longer text keep their logits (server/windows.py)
        # the rows as they are: decode_rows reads their token arrays (collating them cost ~50 us more)
        rows_read = [job.rows[r] for r in plain]
        for task, module in job.modules.items():
            if task not in packed:
                continue
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
            answers = decode_rows(module.manifest.task_type, module.manifest.labels, answers, rows_read,
                                  [row.answer for row in rows_read], module.manifest.decoding)
            for r, answer in zip(plain, answers):
                results[r][task] = answer
        return results

    async def manage(self, task: str, action: str, version: str | None) -> tuple[ModuleView, str | None]:
        ident, future = self._future()
        self._outbox.send(("manage", ident, task, action, version))
        return await future


def run_worker(settings: Settings, engine_path: str, listener: socket.socket, index: int) -> None:
    """A worker process: the HTTP app over a RemoteRuntime, on the shared listening socket."""
    from server.api.app import create_app
    from server.api.http_limits import DrainingServer, uvicorn_config

    # the fork server ignores the stop signals (fork_server.py): SIGTERM, the engine's stop, and SIGHUP end a
    # worker still starting; SIGINT stays ignored until uvicorn takes all three
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, signal.SIG_DFL)
    configure_logging(settings.log_level, settings.log_format)
    if not stop_with_parent():
        log.warning("worker %d (pid %d): the process that started it is gone; not starting", index, os.getpid())
        sys.exit(0)
    one_host_thread()  # decode's small tensors, one request's token lists: the cores belong to the others
    try:
        runtime = RemoteRuntime(settings, engine_path)
    except MetricsFolderFull as exc:
        log.critical("worker %d (pid %d) cannot start: %s", index, os.getpid(), exc)
        sys.exit(1)
    app = create_app(settings, runtime=runtime)
    config = uvicorn_config(app, settings)
    log.info("worker %d (pid %d) serving", index, os.getpid())
    DrainingServer(config).run(sockets=[listener])
